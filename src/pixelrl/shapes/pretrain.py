"""Flow-matching pretraining of the shipped shapes models on rendered (image, caption) pairs:
the scenes world (`builtin:shapes`, GenEval-style prompts) or the text world (`builtin:shapes_text`,
`a sign that says "sun"`, for the OCR reward); and of the editing model (`builtin:shapes_edit`) on
(source, instruction, target) triples, whose own parts are in `pretrain_edit`.

Rectified flow: x_t = (1 - t) x0 + t eps with logit-normal t, target v = eps - x0. The
denoiser and both tiny text encoders train jointly; for the text-to-image models captions are
dropped 10% of the time (replaced by "", the negative prompt) so that classifier-free guidance
works. An EMA of the weights is what gets evaluated and saved.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from pixelrl.core.assets import resolve
from pixelrl.core.errors import ConfigError
from pixelrl.shapes import pretrain_edit, text as shapes_text
from pixelrl.shapes.world import evaluation_items, prompt_splits, render, vocabulary
from pixelrl.shapes.evaluate import evaluate_geneval, evaluate_text, format_table
from pixelrl.engine.learner import LR_SCHEDULES, Learner
from pixelrl.models.base import DiffusionModel
from pixelrl.models.loader import DECLARED_OPTIONS_FILE
from pixelrl.models.sd3 import SD3Model, build_tiny_sd3
from pixelrl.shapes.detector import CATEGORIES

# The shipped architecture (see the model card): pixel space 32 x 32 RGB, patch 4.
SHAPES_ARCH = dict(resolution=32, with_vae=False, with_t5=False, text_hidden=64, text_layers=2, text_max_length=16,
                   num_layers=6, heads=4, head_dim=32, patch_size=4, shift=3.0)


def flow_matching_loss(model: DiffusionModel, x0: torch.Tensor, text, generator: torch.Generator) -> torch.Tensor:
    """mean((v_theta(x_t, t) - (eps - x0))^2) with t ~ logit-normal(0, 1)."""
    t = torch.sigmoid(torch.randn(x0.shape[0], generator=generator))
    eps = torch.randn(x0.shape, generator=generator)
    t_ = t.view(-1, *([1] * (x0.ndim - 1)))
    x_t = (1 - t_) * x0 + t_ * eps
    v = model.predict_velocity(x_t, t, text)
    return ((v - (eps - x0)) ** 2).mean()


def images_to_model_space(images: torch.Tensor) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> float [-1, 1] [B, 3, H, W] (the pixel-space model's latents)."""
    return images.permute(0, 3, 1, 2).float() / 127.5 - 1.0


class CaptionStream:
    """An endless stream of (caption, image) pairs: `draw(rng)` picks a prompt and renders it;
    captions are dropped (replaced by "") at `caption_dropout` for classifier-free guidance."""

    def __init__(self, seed: int, caption_dropout: float = 0.1):
        self.rng = random.Random(seed)
        self.caption_dropout = caption_dropout

    def draw(self, rng: random.Random) -> tuple[str, np.ndarray]:
        raise NotImplementedError

    def batch(self, size: int) -> tuple[list[str], torch.Tensor]:
        captions, images = [], []
        for _ in range(size):
            prompt, image = self.draw(self.rng)
            images.append(torch.from_numpy(image))
            captions.append("" if self.rng.random() < self.caption_dropout else prompt)
        return captions, torch.stack(images)

    def loss(self, model: DiffusionModel, size: int, generator: torch.Generator) -> torch.Tensor:
        """The flow-matching loss of the next `size` pairs."""
        captions, images = self.batch(size)
        text = model._encode_uncached(captions)  # with grad: the text encoders train too
        return flow_matching_loss(model, images_to_model_space(images), text, generator)


def parse_category_weights(text: str) -> dict[str, float]:
    """"two_object=2,position=2" -> a weight for every category (unlisted ones 1), for
    `--category-weights`; a name that is not a category or a weight that is not a finite number
    >= 0 is refused, as are weights that leave nothing to draw."""
    weights = dict.fromkeys(CATEGORIES, 1.0)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in weights:
            raise ConfigError("--category-weights", text, f"{name!r} is not a category; use {list(CATEGORIES)}")
        try:
            weights[name] = float(value)
        except ValueError:
            weights[name] = math.nan
        if not (math.isfinite(weights[name]) and weights[name] >= 0):
            raise ConfigError("--category-weights", text, f"{name}'s weight {value!r} is not a finite number >= 0")
    if not any(weights.values()):
        raise ConfigError("--category-weights", text, "at least one category needs a weight above 0")
    return weights


class ShapesStream(CaptionStream):
    """Scenes from the train prompts; categories uniform, or drawn in proportion to
    `category_weights` (category -> weight)."""

    def __init__(self, seed: int, caption_dropout: float = 0.1, category_weights: dict[str, float] | None = None):
        super().__init__(seed, caption_dropout)
        self.by_cat: dict[str, list[dict]] = {}
        for item in prompt_splits()["train"]:
            self.by_cat.setdefault(item["category"], []).append(item)
        self.weights = [category_weights[c] for c in CATEGORIES] if category_weights else None

    def draw(self, rng):
        # the uniform draw stays rng.choice: the shipped models were trained on its stream
        category = rng.choices(CATEGORIES, self.weights)[0] if self.weights else rng.choice(CATEGORIES)
        item = rng.choice(self.by_cat[category])
        return item["prompt"], render(item["metadata"], rng.randrange(1 << 30))


class TextStream(CaptionStream):
    """The text world's signs, words uniform."""

    def __init__(self, seed: int, caption_dropout: float = 0.1, category_weights: dict[str, float] | None = None):
        super().__init__(seed, caption_dropout)
        if category_weights:
            raise ConfigError("--category-weights", category_weights, "the text world has no categories; "
                              "leave it out with --world text")
        self.items = shapes_text.prompt_items()

    def draw(self, rng):
        item = rng.choice(self.items)
        return item["prompt"], shapes_text.render(item["metadata"]["text"], rng.randrange(1 << 30))


def _validate_scenes(model: DiffusionModel, split: str, per_item: int) -> tuple[dict, str]:
    """(log record, printable table) of the GenEval-style scores on `split`."""
    result = evaluate_geneval(model, evaluation_items(split, per_category=per_item), num_steps=10, guidance_scale=4.0)
    record = {"val_strict": result["strict"], "val_overall": result["overall"],
              "val_overall_partial": result["overall_partial"]}
    return record, format_table(result, f"EMA ({split})")


def _validate_text(model: DiffusionModel, split: str, per_item: int) -> tuple[dict, str]:
    """(log record, printable line) of the OCR scores on `split`."""
    result = evaluate_text(model, shapes_text.evaluation_items(split, per_word=per_item), num_steps=10,
                           guidance_scale=4.0)
    return ({"val_ocr": result["ocr"], "val_ocr_exact": result["exact"]},
            f"EMA ({split}): ocr {result['ocr']:.3f}, exactly readable {result['exact']:.3f}")


def _build_sd3(folder: Path, seed: int, arch: dict, log) -> None:
    build_tiny_sd3(folder, words=vocabulary(), seed=seed, **arch)


def _build_text_sd3(folder: Path, seed: int, arch: dict, log) -> None:
    build_tiny_sd3(folder, words=shapes_text.vocabulary(), seed=seed, **arch)


def _load_sd3(folder: Path) -> SD3Model:
    # trained with CLIP tokens only: loading it with T5's zero tokens would change the model
    return SD3Model(folder, max_sequence_length=0)


def _load_edit(folder: Path) -> DiffusionModel:
    from pixelrl.models.flux_kontext import FluxKontextModel

    return FluxKontextModel(folder, max_sequence_length=pretrain_edit.EDIT_ARCH["text_max_length"])


@dataclass(frozen=True)
class World:
    build: Callable  # (folder, seed, arch, log): a fresh pipeline folder
    load: Callable  # folder -> DiffusionModel
    arch: dict
    stream: type  # (seed, category_weights=) -> an object with .rng and .loss(model, size, generator)
    validate: Callable  # (model, split, per item) -> (log record, printable result)
    per_item: int  # validation items per category / word / kind of edit; the test at the end takes twice as many


WORLDS = {
    "scenes": World(_build_sd3, _load_sd3, SHAPES_ARCH, ShapesStream, _validate_scenes, 32),
    "text": World(_build_text_sd3, _load_sd3, SHAPES_ARCH, TextStream, _validate_text, shapes_text.VAL_SEEDS),
    "edit": World(pretrain_edit.build_edit_model, _load_edit, pretrain_edit.EDIT_ARCH, pretrain_edit.EditStream,
                  pretrain_edit.validate_edits, 24),
}


def _trainable_modules(model: DiffusionModel) -> list[torch.nn.Module]:
    """The denoiser and the text encoders, in the order their folders are named (TRAINED_PARTS)."""
    if isinstance(model, SD3Model):
        return [model.transformer, *model.clip_encoders]
    return [model.transformer, model.pipeline.text_encoder, model.pipeline.text_encoder_2]


TRAINED_PARTS = ("transformer", "text_encoder", "text_encoder_2")


def save_pipeline(model: DiffusionModel, template: Path, out: Path) -> None:
    """Write `model`'s weights into a copy of the pipeline folder `template` (atomic rename), with
    the text length it was trained with declared (loading the SD3 ones with T5's zero tokens, the
    family default, would change the model)."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(template, tmp)
    (tmp / DECLARED_OPTIONS_FILE).write_text(json.dumps({"max_sequence_length": model.max_sequence_length}) + "\n")
    for part, module in zip(TRAINED_PARTS, _trainable_modules(model)):
        module.save_pretrained(tmp / part, safe_serialization=True)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def _check_same_run(out: Path, settings: dict) -> None:
    """A folder holds one run: continuing it with other settings (another world, seed, batch,
    learning rate or architecture) would silently mix two recipes, so it is refused."""
    record = out / "run.json"
    if not record.is_file():
        record.write_text(json.dumps(settings, indent=1))
        return
    saved = json.loads(record.read_text())
    for key in {**saved, **settings}:  # a setting left out now (an init, category weights) differs too
        value = settings.get(key)
        if json.loads(json.dumps(value)) != saved.get(key):
            flag = {"world": "--world", "seed": "--seed", "lr_schedule": "--lr-schedule", "steps": "--steps",
                    "arch": "arch (--text-width, --text-layers)", "init": "--init",
                    "category_weights": "--category-weights", "lr": "--lr"}.get(key, key)
            raise ConfigError(flag, value, f"{out} holds a run started with {key} = {saved.get(key)!r}; "
                              "use that to resume it, or a new folder for a new run")


def _save_state(out: Path, step: int, minutes: float, model: DiffusionModel, ema_model: DiffusionModel, learner: Learner,
                stream, generator: torch.Generator) -> None:
    """Everything a resumed run needs to continue bitwise (`out/state`, replaced atomically):
    raw and EMA weights (safetensors), AdamW and warm-up state and the noise generators (tensors
    only, loaded with weights_only), the step and the data stream's RNG (JSON)."""
    tmp, state, old = out / "state.tmp", out / "state", out / "state.old"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    # cloned: T5 ties its input embeddings to `shared`, and safetensors refuses tensors that share memory
    tensors = {f"{name}.{i}.{key}": value.detach().clone().contiguous()
               for name, m in (("model", model), ("ema", ema_model))
               for i, module in enumerate(_trainable_modules(m)) for key, value in module.state_dict().items()}
    save_file(tensors, tmp / "weights.safetensors")
    # the global generator too: dropout draws from it (the edit model's T5 has some)
    torch.save({"optimizer": learner.optimizer.state_dict(), "scheduler": learner.lr_scheduler.state_dict(),
                "generator": generator.get_state(), "global_generator": torch.get_rng_state()}, tmp / "optimizer.pt")
    version, internal, gauss = stream.rng.getstate()
    (tmp / "state.json").write_text(json.dumps({"step": step, "minutes": minutes,
                                                "stream_rng": [version, list(internal), gauss]}))
    if state.exists():
        shutil.rmtree(old, ignore_errors=True)
        state.rename(old)
    tmp.rename(state)
    shutil.rmtree(old, ignore_errors=True)


def _load_state(out: Path, model: DiffusionModel, ema_model: DiffusionModel, learner: Learner, stream,
                generator: torch.Generator) -> tuple[int, float]:
    """Restore what `_save_state` wrote (the newest complete copy); returns (step, minutes)."""
    folder = next(f for f in (out / "state", out / "state.old") if (f / "state.json").is_file())
    tensors = load_file(folder / "weights.safetensors")
    for name, m in (("model", model), ("ema", ema_model)):
        for i, module in enumerate(_trainable_modules(m)):
            prefix = f"{name}.{i}."
            module.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
    saved = torch.load(folder / "optimizer.pt", weights_only=True)
    learner.optimizer.load_state_dict(saved["optimizer"])
    learner.lr_scheduler.load_state_dict(saved["scheduler"])
    generator.set_state(saved["generator"])
    if "global_generator" in saved:  # states saved before it was kept have none
        torch.set_rng_state(saved["global_generator"])
    meta = json.loads((folder / "state.json").read_text())
    version, internal, gauss = meta["stream_rng"]
    stream.rng.setstate((version, tuple(internal), gauss))
    return meta["step"], meta["minutes"]


def pretrain_shapes(out_dir: str | Path, *, steps: int = 6000, seed: int = 0, batch_size: int = 64,
                    lr: float = 1e-3, warmup: int = 200, ema_decay: float = 0.999, eval_every: int = 1500,
                    eval_per_category: int | None = None, arch: dict | None = None, world: str = "scenes",
                    lr_schedule: str = "constant", init: str | Path | None = None,
                    category_weights: dict[str, float] | None = None, log=print) -> Path:
    """Train for `steps` optimizer steps (a step budget, so a seed reproduces the run);
    evaluate on the validation items and save the EMA weights every `eval_every` steps, with the
    state to resume from. Called again on the same folder (with a larger `steps` to go further),
    it continues from the last saved step exactly as if it had not stopped. `lr_schedule`
    "cosine" decays the learning rate to 0 at `steps` (so the step budget is part of the recipe
    and a cosine run cannot be extended); "constant" keeps it after the warm-up. `init`, a
    pipeline folder this function wrote (e.g. a shipped model's), starts from its weights and
    architecture instead of random ones: pretraining continued, with its own schedule and data.
    `category_weights` draws the scenes' categories in proportion to it instead of uniformly.
    Returns the folder of the final EMA pipeline."""
    if world not in WORLDS:
        raise ValueError(f"world {world!r}: one of {sorted(WORLDS)}")
    # checked before the folder is created: the Learner would raise only after run.json pinned the recipe
    if lr_schedule not in LR_SCHEDULES:
        raise ConfigError("--lr-schedule", lr_schedule, f"one of {list(LR_SCHEDULES)}")
    if lr_schedule == "cosine" and steps <= warmup:
        raise ConfigError("--steps", steps, f"a cosine schedule decays after the {warmup} warm-up steps; "
                          "give more steps than that, or --lr-schedule constant")
    spec = WORLDS[world]
    per_item = eval_per_category or spec.per_item
    init_name = None if init is None else str(init)  # as given: builtin:shapes resolves per install
    if init is not None:
        init = Path(resolve(init_name, "--init"))
        if arch is not None:
            raise ConfigError("--init", init_name, "the architecture is the init pipeline's: leave out the "
                              "architecture options (--text-width, --text-layers)")
        if not all((init / part).exists() for part in ("model_index.json", "transformer", DECLARED_OPTIONS_FILE)):
            raise ConfigError("--init", init_name, "not a shapes pipeline folder (model_index.json, transformer/ "
                              f"and {DECLARED_OPTIONS_FILE}, as pretrain-shapes writes them): give a checkpoints/"
                              "step_N or final folder of a pretraining run, or builtin:shapes")
    stream = spec.stream(seed, category_weights=category_weights)  # refuses weights for the text world
    arch = arch or spec.arch
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    settings = {"world": world, "seed": seed, "batch_size": batch_size, "lr": lr, "warmup": warmup,
                "ema_decay": ema_decay}
    if init is None:
        settings.update(arch=arch)
    else:  # a continued run's architecture is its init's
        settings.update(init=init_name)
    if lr_schedule != "constant":  # runs started before the option existed were constant
        settings.update(lr_schedule=lr_schedule, steps=steps)
    if category_weights:
        settings.update(category_weights=category_weights)
    _check_same_run(out, settings)
    start_from = out / "init"
    if not (start_from / "model_index.json").is_file():
        if init is not None:
            shutil.copytree(init, start_from, ignore=shutil.ignore_patterns("README.md"))
        else:
            spec.build(start_from, seed, arch, log)
    torch.manual_seed(seed)
    model, ema_model = spec.load(start_from), spec.load(start_from)
    params = [p for m in _trainable_modules(model) for p in m.parameters()]
    ema_params = [p for m in _trainable_modules(ema_model) for p in m.parameters()]
    for p in params:
        p.requires_grad_(True)
    for m in _trainable_modules(model):
        m.train()
    n_params = {type(m).__name__: sum(p.numel() for p in m.parameters()) for m in _trainable_modules(model)}
    log(f"parameters: {n_params}")
    learner = Learner(lambda: params, lr=lr, weight_decay=0.0, warmup_steps=warmup, max_grad_norm=1.0,
                      schedule=lr_schedule, total_steps=steps)
    gen = torch.Generator().manual_seed(seed)
    step, minutes = 0, 0.0
    if any((f / "state.json").is_file() for f in (out / "state", out / "state.old")):
        step, minutes = _load_state(out, model, ema_model, learner, stream, gen)
        log(f"resumed at step {step}")
    resumed_at = step
    log_file = (out / "pretrain_log.jsonl").open("a")
    start = time.time() - minutes * 60
    while True:
        elapsed = (time.time() - start) / 60
        if (step % eval_every == 0 and step > 0 or step >= steps) and step != resumed_at:
            for m in _trainable_modules(ema_model):
                m.eval()
            ema_model._prompt_cache.clear()
            record = {"minutes": round(elapsed, 1), "step": step, **spec.validate(ema_model, "val", per_item)[0]}
            log(json.dumps(record))
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()
            save_pipeline(ema_model, start_from, out / "checkpoints" / f"step_{step:06d}")
            _save_state(out, step, elapsed, model, ema_model, learner, stream, gen)
        if step >= steps:
            break
        loss = stream.loss(model, batch_size, gen)
        learner.zero_grad()
        loss.backward()
        # a non-finite loss or gradient skips the step; three in a row stop the run
        grad_norm = learner.step(float(loss.detach())).get("grad_norm", float("nan"))
        step += 1
        decay = min(ema_decay, (1 + step) / (10 + step))
        with torch.no_grad():
            torch._foreach_lerp_(ema_params, params, 1 - decay)
        if step % 100 == 0:
            record = {"step": step, "minutes": round((time.time() - start) / 60, 2), "loss": float(loss.detach()),
                      "grad_norm": float(grad_norm)}
            log_file.write(json.dumps(record) + "\n")
            log_file.flush()
            if step % 500 == 0:
                log(json.dumps(record))
    final = out / "final"
    save_pipeline(ema_model, start_from, final)
    log(f"after {steps} steps:\n" + spec.validate(ema_model, "test", 2 * per_item)[1])
    return final
