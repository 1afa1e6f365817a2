"""Deterministic generation from a model or a training checkpoint, and the measures of its images
that do not depend on a reward: a fixed-seed mean reward, the diversity within a prompt."""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch

from pixelrl.core.errors import ConfigError
from pixelrl.models.base import DiffusionModel
from pixelrl.sampling.rollout import SamplingSettings, rollout
from pixelrl.sampling.windows import Window


@torch.no_grad()
def generate(model: DiffusionModel, prompts: list[str], seeds: list[int], *, num_steps: int = 10,
             guidance_scale: float = 4.0, resolution: int = 32, negative_prompt: str = "",
             batch_size: int = 128) -> torch.Tensor:
    """uint8 images [B, H, W, 3] from the ODE sampler (no noise injected), one per (prompt, seed)."""
    sigmas = model.sigmas(num_steps, resolution, resolution)
    settings = SamplingSettings(noise_level=0.0, guidance_scale=guidance_scale)
    images = []
    for start in range(0, len(prompts), batch_size):
        out = rollout(model, prompts[start:start + batch_size], seeds[start:start + batch_size], sigmas=sigmas,
                      window=Window(0, 0), settings=settings, height=resolution, width=resolution,
                      negative_prompt=negative_prompt)
        images.append(out.images)
    return torch.cat(images)


@torch.no_grad()
def fixed_seed_reward(engine, reward, prompts: list[str], seeds: list[int]) -> float:
    """Mean overall reward of one image per (prompt, seed), sampled with the engine's own
    rollout settings: a fixed-seed evaluation of its current policy."""
    batch = engine.rollout(prompts, seeds)
    return float(reward(batch["images"], prompts, [{}] * len(prompts))["overall"].mean())


def load_for_eval(model_path: str | None = None, checkpoint: str | None = None):
    """The model to evaluate: a pipeline folder (or `builtin:shapes`), or a training checkpoint
    (its base model with the trained weights of `global_step_N/actor` applied, their EMA when the
    run kept one). A folder loads with its family's defaults and the options its
    pixelrl_model.json declares."""
    from pathlib import Path

    from pixelrl.models.loader import load_configured_model, load_folder_model

    if checkpoint is None:
        return load_folder_model(str(model_path or "builtin:shapes"))
    from pixelrl.core.config_io import from_yaml_text
    from pixelrl.engine.checkpoint import load_engine
    from pixelrl.engine.policy_engine import PolicyEngine

    folder = Path(checkpoint)
    for needed in ("config.yaml", "actor"):
        if not (folder / needed).exists():
            where = "the folder does not exist" if not folder.is_dir() else f"it holds no {needed}"
            raise ConfigError("--checkpoint", str(checkpoint), f"{where}: give a global_step_N folder of a training "
                              "run (RUN/checkpoints/global_step_N, holding config.yaml and actor/)")
    cfg = from_yaml_text((folder / "config.yaml").read_text())
    _check_same_base(cfg.model.path, model_path)
    model = load_configured_model(cfg.model, model_path)
    engine = PolicyEngine(model, cfg)
    load_engine(engine, folder / "actor")
    if engine.weights_ema is not None:  # the weights the run's validation scored (actor.ema_decay)
        engine.weights_ema.copy_to_params()
    return engine.model


def _check_same_base(trained_on: str, model_path: str | None) -> None:
    """`--model` with a checkpoint names where its base model lives now; naming another model
    while the one it trained on is still there would apply its weights to the wrong base (images
    of neither, no error: LoRA shapes match across same-architecture models)."""
    from pathlib import Path

    from pixelrl.core.assets import resolve

    if model_path is None:
        return
    trained, given = (Path(resolve(str(p))).expanduser().resolve() for p in (trained_on, model_path))
    if trained.is_dir() and trained != given:
        raise ConfigError("--model", str(model_path), f"the checkpoint was trained on {trained_on}, which is still "
                          "there: leave --model out to use it (--model is for a base model that has moved)")


def diversity(images: torch.Tensor, items: list[dict]) -> dict[str, float]:
    """How different the images of one prompt are (different seeds): the mean pairwise L1
    distance between them (0..1), and the fraction of pairs that differ at all (distinct)."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, item in enumerate(items):
        groups[item["prompt"]].append(i)
    distances, distinct = [], []
    x = images.float() / 255.0
    for idx in groups.values():
        for a in range(len(idx)):
            for b in range(a + 1, len(idx)):
                d = float((x[idx[a]] - x[idx[b]]).abs().mean())
                distances.append(d)
                distinct.append(d > 0.01)
    return {"pairwise_l1": float(np.mean(distances)) if distances else 0.0,
            "distinct_pair_fraction": float(np.mean(distinct)) if distinct else 0.0}
