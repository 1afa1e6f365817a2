"""Every reward on one batch: images/s scored in one process (2 threads), through the same
`WeightedReward` the trainer calls, after one warm-up call (model loads happen there).

Inputs: shapes-world scenes at 32 px with their prompts (the OCR reward gets 160 px cards with a
quoted word instead). Model-based rewards (CLIP score, PickScore, aesthetic, HPSv2, ImageReward, the VLM judges) run
on tiny random models written offline here, so their rows measure pixelrl's overhead around the
model (preprocessing, batching, checks), not the cost of a real ViT-L/14 or a 7B judge: a real
model's forward adds its own FLOPs on top. `remote` goes through `pixelrl serve-reward` on
127.0.0.1 (PNG encoding, HTTP, decoding) around `jpeg_compressibility`.

    python benchmarks/bench_rewards.py                  # batch 64, median of 5 calls
    python benchmarks/bench_rewards.py --batch 16 --repeats 3
    python benchmarks/bench_rewards.py --only hpsv2 image_reward   # some rows
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import peak_rss_mb  # noqa: E402


def _inputs(batch: int):
    import numpy as np
    import torch
    from PIL import Image, ImageDraw, ImageFont

    from pixelrl.shapes.world import evaluation_items, render

    items = evaluation_items("test", per_category=max(1, batch // 6 + 1), seed=0)[:batch]
    scenes = torch.from_numpy(np.stack([render(it["metadata"], it["seed"]) for it in items]))
    prompts = [it["prompt"] for it in items]
    metadata = [it["metadata"] for it in items]
    words = ["pixelrl", "hello", "reward", "flow", "grpo", "shapes"]
    cards = []
    for i in range(batch):
        card = Image.new("RGB", (160, 160), "white")
        ImageDraw.Draw(card).text((8, 50), words[i % len(words)], fill="black",
                                  font=ImageFont.load_default(size=26))
        cards.append(np.array(card))
    ocr_prompts = [f'a card saying "{words[i % len(words)]}"' for i in range(batch)]
    vlm_meta = [{"image": np.asarray(s), "question": "what colour is the shape?"} for s in scenes.numpy()]
    return scenes, prompts, metadata, torch.from_numpy(np.stack(cards)), ocr_prompts, vlm_meta


def _models(root: Path) -> dict[str, str]:
    import torch
    from safetensors.torch import save_file

    from pixelrl.shapes import qa as shapes_qa
    from pixelrl.models.qwen_vl.tiny import build_tiny_qwen_vl
    from pixelrl.testing import build_tiny_blip_itm, build_tiny_clip
    from pixelrl.rewards.clip import aesthetic_head

    clip = build_tiny_clip(root / "clip")
    (root / "aesthetic").mkdir()
    build_tiny_clip(root / "aesthetic" / "clip")
    head = torch.nn.Module()
    head.layers = aesthetic_head(16)
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(root / "aesthetic" / "head.safetensors"))
    vlm = build_tiny_qwen_vl(root / "vlm", words=shapes_qa.vocabulary() + ["yes", "no", "correct"], seed=0)
    image_reward = build_tiny_blip_itm(root / "image_reward")  # a BLIP folder + ImageReward's head
    head = torch.nn.Module()
    head.layers = aesthetic_head(32)
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(image_reward / "head.safetensors"))
    return {"clip": str(clip), "aesthetic": str(root / "aesthetic"), "vlm": str(vlm), "image_reward": str(image_reward)}


def _serve(reward: str):
    from pixelrl.rewards.server import RewardServer

    server = RewardServer(reward, {}, host="127.0.0.1", port=0, token=None)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", nargs="+", help="reward names to run (default: every row)")
    args = parser.parse_args()

    import torch

    from pixelrl.core.plugins import import_extensions
    from pixelrl.core.quiet import quiet_libraries
    from pixelrl.rewards import WeightedReward

    quiet_libraries()
    import_extensions()  # an entry point: the shapes world's and the VLM trainer's rewards
    torch.set_num_threads(args.threads)
    scenes, prompts, metadata, cards, ocr_prompts, vlm_meta = _inputs(args.batch)
    with tempfile.TemporaryDirectory() as tmp:
        paths = _models(Path(tmp))
        server = _serve("jpeg_compressibility")
        answers = ["red"] * args.batch
        questions = [m["question"] for m in vlm_meta]
        rows = [  # (name shown, reward spec, images / responses, prompts, metadata, what it scores)
            ("jpeg_compressibility", {"name": "jpeg_compressibility"}, scenes, prompts, metadata, "32 px scenes"),
            ("shapes_geneval", {"name": "shapes_geneval"}, scenes, prompts, metadata, "32 px scenes"),
            ("ocr", {"name": "ocr"}, cards, ocr_prompts, [{}] * args.batch, "160 px cards"),
            ("clip_score (tiny CLIP)", {"name": "clip_score", "options": {"path": paths["clip"]}}, scenes, prompts,
             metadata, "32 px scenes"),
            ("pickscore (tiny CLIP)", {"name": "pickscore", "options": {"path": paths["clip"]}}, scenes, prompts,
             metadata, "32 px scenes"),
            ("aesthetic (tiny CLIP + head)", {"name": "aesthetic", "options": {"path": paths["aesthetic"]}}, scenes,
             prompts, metadata, "32 px scenes"),
            ("hpsv2 (tiny CLIP)", {"name": "hpsv2", "options": {"path": paths["clip"]}}, scenes, prompts, metadata,
             "32 px scenes"),
            ("image_reward (tiny BLIP + head)", {"name": "image_reward", "options": {"path": paths["image_reward"]}},
             scenes, prompts, metadata, "32 px scenes"),
            ("vlm_judge (tiny Qwen2-VL)", {"name": "vlm_judge", "options": {"path": paths["vlm"]}}, scenes, prompts,
             metadata, "32 px scenes"),
            ("answer_judge (tiny Qwen2-VL)", {"name": "answer_judge", "options": {"path": paths["vlm"]}}, answers,
             questions, vlm_meta, "answers + 32 px scenes"),
            ("pairwise_win_rate (jpeg)", {"name": "pairwise_win_rate", "options": {"reward": "jpeg_compressibility"}},
             scenes, prompts, metadata, "32 px scenes"),
            ("remote (jpeg, loopback)", {"name": "remote", "options": {"url": server.url}}, scenes, prompts, metadata,
             "32 px scenes"),
        ]
        print(f"# batch {args.batch}, {args.threads} threads, median of {args.repeats} calls after 1 warm-up; "
              "tiny random models for the model-based rewards (overhead, not a real model's cost)")
        print("| reward | input | images/s | ms per call |")
        print("|---|---|---|---|")
        rows = [row for row in rows if not args.only or row[1]["name"] in args.only]
        for name, spec, images, texts, meta, what in rows:
            reward = WeightedReward.from_functions([spec])
            reward(images, texts, meta)  # warm-up: model loads, caches
            seconds = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                reward(images, texts, meta)
                seconds.append(time.perf_counter() - start)
            median = statistics.median(seconds)
            print(f"| {name} | {what} | {args.batch / median:.0f} | {median * 1000:.1f} |", flush=True)
        server.close()
    print(f"peak RSS {peak_rss_mb():.0f} MB")


if __name__ == "__main__":
    main()
