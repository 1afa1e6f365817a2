"""Rewards outside training: `serve-reward`, `convert-reward`."""

from __future__ import annotations

import os
from pathlib import Path

from pixelrl.cli.arguments import non_negative_int, positive_float, positive_int


def reward_options(args) -> dict:
    """`--reward-options` parsed as JSON and checked against `--reward`'s options."""
    import json

    from pixelrl.core.errors import ConfigError
    from pixelrl.rewards.registry import check_reward_options

    from pixelrl.core.plugins import import_plugins
    from pixelrl.rewards import REWARDS

    import_plugins(args.plugin or [], field="--plugin")
    REWARDS.get(args.reward, field="--reward")  # unknown: the registry's error and plugins hint
    try:
        options = json.loads(args.reward_options)
    except json.JSONDecodeError as err:
        raise ConfigError("--reward-options", args.reward_options, f"not JSON ({err.msg})") from None
    if not isinstance(options, dict):
        raise ConfigError("--reward-options", args.reward_options, 'a JSON object, e.g. {"strict_weight": 0.5}')
    check_reward_options(args.reward, options, field="--reward-options")
    return options


def cmd_serve_reward(args) -> int:
    import pixelrl.rewards  # noqa: F401  (registers the rewards)
    from pixelrl.rewards.server import RewardServer
    from pixelrl.rewards.wire import Limits

    from pixelrl.core.errors import ConfigError

    if args.port > 65535:
        raise ConfigError("--port", args.port, "a TCP port in 0..65535 (0 picks a free one)")
    options = reward_options(args)
    token = os.environ.get(args.token_env) or None
    server = RewardServer(args.reward, options, host=args.host, port=args.port, token=token,
                          max_request_mb=args.max_request_mb, token_env=args.token_env,
                          limits=Limits(max_images=args.max_images, max_pixels=args.max_pixels))
    print(f"serving reward `{args.reward}` at {server.url} (POST /score, GET /health; "
          f"{'bearer token from $' + args.token_env if token else 'no token: loopback only'}); Ctrl-C stops",
          flush=True)
    try:
        server.serve_forever()
    finally:
        server.close()
    return 0


# convert-reward: the reward, its converter's module, the released file, and the base folder it needs
CONVERTIBLE_REWARDS = {
    "image_reward": ("pixelrl.rewards.image_reward", "ImageReward.pt",
                     "a local transformers BLIP image-text-matching folder of ViT-L size (config.json, tokenizer "
                     "and preprocessor files), e.g. a copy of blip-itm-large-coco"),
    "hpsv2": ("pixelrl.rewards.hps", "HPS_v2.1_compressed.pt (or HPS_v2_compressed.pt)",
              "a local transformers copy of CLIP-ViT-H-14-laion2B-s32B-b79K (config.json, tokenizer and "
              "preprocessor files)"),
}


def cmd_convert_reward(args) -> int:
    import importlib

    from pixelrl.core.errors import ConfigError

    module, released, base = CONVERTIBLE_REWARDS[args.reward]
    if not Path(args.checkpoint).is_file():
        raise ConfigError("<checkpoint>", args.checkpoint, f"the released {released} file (a local copy)")
    if Path(args.out).exists() and (not Path(args.out).is_dir() or any(Path(args.out).iterdir())):
        raise ConfigError("<out>", args.out, "an empty or new folder (nothing is overwritten)")
    if not (Path(args.base) / "config.json").is_file():
        raise ConfigError("--base", args.base, base)
    out = importlib.import_module(module).convert_checkpoint(args.checkpoint, args.base, args.out)
    print(f"wrote {out}: use it as reward.functions=[{{name: {args.reward}, options: {{path: {out}}}}}]")
    return 0


def add_parsers(sub) -> None:
    serve = sub.add_parser("serve-reward", help="serve a registered reward over HTTP (JSON + PNG, never pickle)")
    serve.add_argument("--reward", required=True, help="a registered reward name, e.g. ocr or shapes_geneval")
    serve.add_argument("--reward-options", default="{}", help="the reward's options as JSON")
    serve.add_argument("--plugin", action="append", help="a module or .py file registering your reward (repeatable)")
    serve.add_argument("--host", default="127.0.0.1", help="listen address (a non-loopback one needs a token)")
    serve.add_argument("--port", type=non_negative_int, default=8765, help="TCP port to listen on (0: any free one)")
    serve.add_argument("--token-env", default="PIXELRL_REWARD_TOKEN",
                       help="environment variable holding the bearer token (never pass it on the command line)")
    serve.add_argument("--max-request-mb", type=positive_float, default=64.0,
                       help="the largest request body accepted, in MB (larger ones get 413)")
    serve.add_argument("--max-images", type=positive_int, default=1024, help="images per request")
    serve.add_argument("--max-pixels", type=positive_int, default=4096 * 4096, help="pixels per image")
    serve.set_defaults(func=cmd_serve_reward)
    convert = sub.add_parser("convert-reward", help="a released reward checkpoint + its local base folder -> a "
                             "reward folder (image_reward, hpsv2)")
    convert.add_argument("reward", choices=sorted(CONVERTIBLE_REWARDS), help="the reward whose model to convert")
    convert.add_argument("checkpoint", help="the released .pt file (read as tensors only)")
    convert.add_argument("out", help="the folder to write the converted model to")
    convert.add_argument("--base", required=True, help="the local transformers folder of the base model "
                         "(config, tokenizer, processor)")
    convert.set_defaults(func=cmd_convert_reward)
