"""On-policy distillation's teachers inside an engine: a whole fine-tuned teacher's frozen copy,
and the replay of a batch's rows, each under its data_source's teacher."""

from __future__ import annotations

import torch

from pixelrl.core.batch import Batch
from pixelrl.core.errors import ConfigError
from pixelrl.engine.checkpoint import TeacherWeights, teacher_state
from pixelrl.models.lora import add_adapter_from_folder, lora_modules_absent


def holding_teacher(copy: torch.nn.Module, weights: TeacherWeights, spec: str) -> torch.nn.Module:
    """`copy` (a frozen copy of the base denoiser, before any adapter) holding a whole teacher's
    weights: every parameter of the base must be there with its shape."""
    state = teacher_state(weights)
    params = dict(copy.named_parameters())
    missing = sorted(set(params) - set(state))
    wrong = sorted(n for n in set(params) & set(state) if state[n].shape != params[n].shape)
    if missing or wrong:
        detail = (f"{len(missing)} of the base's parameters are not there ({missing[:2]})" if missing else
                  f"{wrong[0]} is {tuple(state[wrong[0]].shape)} there, {tuple(params[wrong[0]].shape)} in the base")
        raise ConfigError("diffusion_loss.teacher", spec, f"its weights ({weights.path}) are not a denoiser of this "
                          f"model's shape: {detail}; name a checkpoint or pipeline folder of model.path's family and size")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(state[name])
    return copy


def add_teacher_adapter(transformer: torch.nn.Module, name: str, weights: TeacherWeights, spec: str) -> None:
    """A teacher LoRA as the frozen adapter `name` beside the student's, refused when it adapts
    modules this denoiser lacks (diffusers would apply the rest without a word)."""
    absent, adapted = lora_modules_absent(transformer, weights.path)
    if absent:
        raise ConfigError("diffusion_loss.teacher", spec, f"{len(absent)} of the {adapted} modules its LoRA adapts are "
                          f"not in model.path's denoiser (e.g. `{absent[0]}`): it is a LoRA of another model or size "
                          "and would be applied in part; name a LoRA trained on model.path's base")
    add_adapter_from_folder(transformer, name, weights.path)


def score_by_teacher(engine, batch: Batch, settings) -> Batch:
    """`teacher_log_probs` and `teacher_means` of every stored step of `batch` under `engine`'s
    teachers, each row under its data_source's (`*`'s for a source not named, and for a batch
    without sources); the base teacher is the reference."""
    routes = engine.teacher_of_source
    if not routes:
        raise ValueError("this engine has no distillation teacher: its loss is not distill_kl and "
                         "diffusion_loss.distill_coef is 0, or the rollout pool replays it (rollout.scores_teacher)")
    teachers = engine.teacher_of_rows(batch)
    # under FSDP2 every rank must run the same forwards (each all-gathers the weights), while
    # ranks hold rows of different sources: there each teacher replays every row
    every_row = engine.mesh.distributed and engine.mesh.strategy == "fsdp2"
    log_probs = means = None
    for teacher in dict.fromkeys(routes.values() if every_row else teachers):
        rows = torch.tensor([i for i, t in enumerate(teachers) if t == teacher], dtype=torch.long)
        with engine.policy(teacher or "reference"):
            if every_row:
                lp, mu = engine.replay(batch, settings)
                lp, mu = lp[rows], mu[rows]
            else:
                lp, mu = engine.replay(batch.select(rows), settings)
        if log_probs is None:
            log_probs = lp.new_zeros((len(batch), *lp.shape[1:]))
            means = mu.new_zeros((len(batch), *mu.shape[1:]))
        log_probs[rows], means[rows] = lp, mu
    return Batch({"teacher_log_probs": log_probs, "teacher_means": means})
