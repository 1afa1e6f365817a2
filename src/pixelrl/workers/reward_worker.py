"""Reward scoring off the driver: a worker holds the configured rewards and scores image shards."""

from __future__ import annotations

import numpy as np


class RewardWorker:
    def __init__(self, functions: list[dict], num_threads: int | None = None, plugins: tuple = (),
                 timeout_s: float = 0.0):
        self.functions = functions
        self.num_threads = num_threads
        self.plugins = list(plugins)
        self.timeout_s = timeout_s  # reward.timeout_s: the deadline of each reward function's call
        self.reward = None

    def setup(self) -> list[str]:
        import torch

        import pixelrl.rewards  # noqa: F401
        from pixelrl.core.plugins import import_plugins
        from pixelrl.core.quiet import quiet_libraries
        from pixelrl.rewards import WeightedReward

        quiet_libraries()
        import_plugins(self.plugins)  # a reward of the user's own registers here
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        self.reward = WeightedReward.from_functions(self.functions, self.timeout_s)
        return self.reward.component_names

    def score(self, images: np.ndarray, prompts: list[str], metadata: list[dict],
              condition_images: list | None = None, groups: list | None = None) -> dict[str, np.ndarray]:
        import torch

        out = self.reward(torch.from_numpy(np.array(images, copy=True)), prompts, metadata, condition_images, groups)
        return {k: v.numpy() for k, v in out.items()}

    def score_rollout(self, metadata: list[dict], *payloads: dict, groups: list | None = None) -> dict:
        """Score rollout shards (the rollout verb's numpy payloads, in order) as one batch; with
        wall-clock start/end. Several shards come together when a reward needs whole groups
        (each image's key in `groups`)."""
        import time

        start = time.time()
        images = np.concatenate([p["tensors"]["images"] for p in payloads])
        prompts = [prompt for p in payloads for prompt in p["values"]["prompts"]]
        sources = [row for p in payloads for row in p["values"].get("condition_images", ())] or None
        scores = self.score(images, prompts, metadata, sources, groups)
        return {"scores": scores, "start": start, "end": time.time()}
