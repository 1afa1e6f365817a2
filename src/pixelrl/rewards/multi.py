"""Several rewards scored together and combined with weights."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from pixelrl.core.errors import ConfigError, PixelRLError, RewardError
from pixelrl.rewards.registry import RewardFn, check_reward_output, get_reward


@dataclass
class RewardSpec:
    name: str
    weight: float = 1.0
    options: dict = field(default_factory=dict)


class WeightedReward:
    """Scores every component reward and adds `overall` = sum_k w_k r_k.

    Each component's outputs are checked (shape [B], finite tensors) and named after it. A
    component that returns several keys contributes the one named like itself, or its only key.
    """

    def __init__(self, specs: list[RewardSpec], timeout_s: float = 0.0):
        if not specs:
            raise ConfigError("reward.functions", specs, "list at least one reward, e.g. [{name: jpeg_compressibility}]")
        self.specs = specs
        self.functions: list[RewardFn] = [get_reward(s.name, **s.options) for s in specs]
        self.timeout_s = timeout_s  # per call of one reward function (reward.timeout_s); 0 = none

    @classmethod
    def from_functions(cls, functions: list[dict], timeout_s: float = 0.0) -> "WeightedReward":
        """From `reward.functions` entries: {name, weight (1.0), options ({})}."""
        return cls([RewardSpec(f["name"], float(f.get("weight", 1.0)), dict(f.get("options", {}))) for f in functions],
                   timeout_s)

    def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict],
                 condition_images: list | None = None, groups: list | None = None) -> dict[str, torch.Tensor]:
        """Each function's scores and the weighted `overall`; a function that reads the sources
        (`reads_condition_images`) gets the rows' `condition_images`, a group-wise one (`groupwise`)
        each image's group key (`groups`: its row's uid; None groups by prompt)."""
        batch = len(images)  # images [B, H, W, 3], videos [B, T, H, W, 3], or B response strings for a VLM
        scores: dict[str, torch.Tensor] = {}
        overall = torch.zeros(batch)
        for spec, fn in zip(self.specs, self.functions):
            if getattr(fn, "reads_condition_images", False):
                fn = _with_sources(spec.name, fn, condition_images)
            if getattr(fn, "groupwise", False):
                fn = _in_groups(fn, groups)
            if getattr(images, "ndim", 0) == 5 and not getattr(fn, "scores_videos", False):
                out = _per_frame(spec.name, fn, images, prompts, metadata, self.timeout_s)
            else:
                out = check_reward_output(spec.name, _call(spec.name, fn, images, prompts, metadata, self.timeout_s),
                                          batch)
            main_key = spec.name if spec.name in out else (next(iter(out)) if len(out) == 1 else None)
            if main_key is None:
                raise ConfigError(
                    f"reward `{spec.name}`", sorted(out),
                    f"returns several keys and none is named `{spec.name}`: name its main score after the reward",
                )
            for key, value in out.items():
                scores[key if key != main_key else spec.name] = value
            overall = overall + spec.weight * out[main_key]
        if not torch.isfinite(overall).all():
            raise RewardError(f"the weighted sum of the rewards overflowed ({overall.tolist()[:4]}...): weights "
                              f"{self.weights} times the scores leave float32's range; lower the weights")
        scores["overall"] = overall
        return scores

    @property
    def component_names(self) -> list[str]:
        return [s.name for s in self.specs]

    @property
    def weights(self) -> list[float]:
        return [s.weight for s in self.specs]


def _per_frame(name: str, fn: RewardFn, videos, prompts, metadata, timeout_s: float = 0.0) -> dict[str, torch.Tensor]:
    """An image reward on videos: every frame scored with its video's prompt and metadata, the
    scores averaged per video. A reward that scores whole videos sets `fn.scores_videos = True`."""
    batch, frames = videos.shape[:2]
    out = check_reward_output(name, _call(name, fn, videos.reshape(batch * frames, *videos.shape[2:]),
                                          [p for p in prompts for _ in range(frames)],
                                          [m for m in metadata for _ in range(frames)], timeout_s), batch * frames)
    return {key: value.reshape(batch, frames).mean(dim=1) for key, value in out.items()}


class _PastDeadline(Exception):
    """A reward call still running at its deadline (not an error the reward raised)."""


def _within(call, timeout_s: float):
    """`call()` on a daemon thread, waited for at most `timeout_s` seconds: its value or its
    exception, or _PastDeadline. A thread cannot be stopped, so one past its deadline is left to
    finish on its own (daemon: it never holds the process open at exit)."""
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as err:  # re-raised in the caller's thread, SystemExit included
            outcome["error"] = err

    thread = threading.Thread(target=run, name="reward-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise _PastDeadline
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _with_sources(name: str, fn, condition_images):
    if not condition_images or not all(condition_images):
        raise RewardError(f"reward `{name}` reads each sample's source image and these samples have none: use it "
                          "with an edit family (model.type=flux_kontext or qwen_image_edit) on rows that name an `image`")
    return lambda images, prompts, metadata: fn(images, prompts, metadata, condition_images=condition_images)


def _in_groups(fn, groups):
    return lambda images, prompts, metadata: fn(images, prompts, metadata, groups=groups)


def _call(name: str, fn: RewardFn, images, prompts, metadata, timeout_s: float = 0.0):
    """A reward that raises stops the run with its name, the exception and where it was raised
    (the file and line in the reward's own code), not a trace through the trainer. A reward that
    calls sys.exit() fails the same way (it would otherwise end training with exit 0 and no
    checkpoint); KeyboardInterrupt is left alone, since it is how Ctrl-C reaches the trainer. With
    `timeout_s`, a call that gives no scores in time fails the same way (reward.timeout_s)."""
    try:
        if timeout_s > 0:
            try:
                return _within(lambda: fn(images, prompts, metadata), timeout_s)
            except _PastDeadline:
                raise RewardError(f"reward `{name}` gave no scores for {len(prompts)} samples within "
                                  f"reward.timeout_s={timeout_s:g} s: fix the reward (a hang, a server that does "
                                  "not answer), or raise reward.timeout_s (0 = no deadline)") from None
        return fn(images, prompts, metadata)
    except PixelRLError:
        raise
    except (Exception, SystemExit) as err:
        import traceback

        frame = traceback.extract_tb(err.__traceback__)[-1]
        raise RewardError(f"reward `{name}` raised {type(err).__name__}: {err} (at {frame.filename}:{frame.lineno}, "
                          f"in {frame.name}) scoring {len(prompts)} samples; fix the reward or remove it from "
                          "reward.functions") from err
