"""`PolicyEngine`: one diffusion model, its optimizer and adapters; rollout, score, update.

The engine is what a worker runs. It knows nothing about Ray or about other workers except
through an optional `grad_sync` hook (DDP/FSDP wrap the denoiser from outside).
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections import defaultdict

import torch

from pixelrl.algos.losses import get_loss, require_keys
from pixelrl.core.batch import Batch
from pixelrl.core.config import EngineConfig
from pixelrl.core.errors import ConfigError
from pixelrl.models.base import DiffusionModel
from pixelrl.models.lora import adapters_disabled, add_lora
from pixelrl.sampling.rollout import SamplingSettings, rollout, step_with_log_prob
from pixelrl.sampling.schedule import schedule_sigmas
from pixelrl.sampling.windows import Window, full_window

POLICIES = ("current", "old", "reference")


class PolicyEngine:
    def __init__(self, model: DiffusionModel, cfg: EngineConfig):
        self.model = model
        self.cfg = cfg
        self.loss = get_loss(cfg.diffusion_loss.name)
        self.kl = get_loss("kl") if cfg.diffusion_loss.kl_coef > 0 else None
        self.settings = SamplingSettings(
            noise_level=cfg.rollout.noise_level,
            sde_type=cfg.rollout.sde_type,
            guidance_scale=cfg.rollout.guidance_scale,
            logprob_reduction=cfg.rollout.logprob_reduction,
        )
        self.sigmas = schedule_sigmas(model.scheduler, cfg.rollout.num_steps, cfg.rollout.sigma_schedule)

        mcfg = cfg.model
        torch.manual_seed(cfg.seed)
        self.use_lora = mcfg.lora_rank > 0
        self._frozen_reference = None
        if self.use_lora:
            targets = mcfg.lora_target_modules or model.default_lora_targets
            add_lora(model.transformer, rank=mcfg.lora_rank, alpha=mcfg.lora_alpha,
                     target_modules=targets, init=mcfg.lora_init)
        else:
            model.transformer.requires_grad_(True)
            if self.kl is not None:  # full fine-tuning keeps a frozen copy as the reference
                self._frozen_reference = copy.deepcopy(model.transformer).requires_grad_(False).eval()
        if mcfg.gradient_checkpointing:
            model.transformer.enable_gradient_checkpointing()
        if not model.trainable_parameters():
            raise ConfigError("model.lora_target_modules", mcfg.lora_target_modules, "no parameter is trainable")
        self.rebuild_optimizer()
        # Counts optimizer steps; a batch remembers the version that sampled it, so the engine
        # knows when the current weights ARE the rollout policy.
        self.policy_version = 0
        self.update_calls = 0
        self.nonfinite_in_a_row = 0
        # Hook for distributed data parallelism: called with the trainable parameters after
        # the backward passes of a mini-batch, before clipping (gloo/NCCL all-reduce).
        self.grad_sync = None
        # Ranks sharing each optimizer step; `actor.ppo_mini_batch_size` counts images over all.
        self.data_parallel_size = 1

    def rebuild_optimizer(self) -> None:
        """(Re)create AdamW and its schedule over the current trainable parameters (again after
        FSDP2 turns them into sharded DTensors)."""
        acfg = self.cfg.actor
        self.optimizer = torch.optim.AdamW(
            self.model.trainable_parameters(), lr=acfg.lr, betas=tuple(acfg.betas),
            weight_decay=acfg.weight_decay, eps=acfg.adam_eps,
        )
        warmup = max(int(acfg.warmup_steps), 0)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )

    # ------------------------------------------------------------------ rollout
    @property
    def stores_old_means(self) -> bool:
        return "old_means" in self.loss.batch_keys

    def default_window(self) -> Window:
        return full_window(self.cfg.rollout.num_steps)

    def rollout(self, prompts: list[str], seeds: list[int], *, window: Window | None = None,
                settings: SamplingSettings | None = None, num_steps: int | None = None,
                noise_seeds: list[int] | None = None) -> Batch:
        """Sample one image per (prompt, seed) with the current policy, in micro-batches."""
        settings = settings or self.settings
        sigmas = (self.sigmas if num_steps is None
                  else schedule_sigmas(self.model.scheduler, num_steps, self.cfg.rollout.sigma_schedule))
        window = window or (self.default_window() if num_steps is None else full_window(num_steps))
        res = self.cfg.rollout.resolution
        self.model.transformer.eval()
        chunks = []
        size = max(1, self.cfg.rollout.micro_batch_size)
        for start in range(0, len(prompts), size):
            out = rollout(
                self.model, prompts[start:start + size], seeds[start:start + size],
                sigmas=sigmas, window=window, settings=settings, height=res, width=res,
                negative_prompt=self.cfg.rollout.negative_prompt, store_means=self.stores_old_means,
                noise_seeds=None if noise_seeds is None else noise_seeds[start:start + size],
            )
            tensors = {
                "images": out.images, "latents": out.latents.cpu(), "log_probs": out.log_probs.cpu(),
                "sigmas": out.sigmas, "sigmas_next": out.sigmas_next,
                # schedule position of each stored column (windows differ between batches)
                "step_indices": torch.tensor(window.steps(), dtype=torch.long).expand(len(out.images), -1).clone(),
            }
            if out.means is not None:
                tensors["old_means"] = out.means.cpu()
            chunks.append(Batch(tensors, {"prompts": list(prompts[start:start + size]),
                                          "seeds": list(seeds[start:start + size])}))
        batch = Batch.concat(chunks)
        batch.info.update(
            policy_version=self.policy_version,
            window=(window.start, window.end),
            sampling=settings.as_dict(),
            sigma_max_next=float(sigmas[1]),
        )
        return batch

    # ------------------------------------------------------------------ scoring
    @contextlib.contextmanager
    def _policy(self, which: str):
        """Make `self.model` compute with the requested policy's weights for the duration.

        `current` and `old` are the weights as they are now (in a colocated engine the old
        policy is the current one before this step's update); `reference` is the base model:
        LoRA adapters disabled, or the frozen copy kept for full fine-tuning.
        """
        if which not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {which!r}")
        if which != "reference":
            yield
        elif self.use_lora:
            with adapters_disabled(self.model.transformer):
                yield
        else:
            if self._frozen_reference is None:
                self._frozen_reference = copy.deepcopy(self.model.transformer).requires_grad_(False).eval()
            trained = self.model.transformer
            self.model.transformer = self._frozen_reference
            try:
                yield
            finally:
                self.model.transformer = trained

    def _step_outputs(self, micro: Batch, step: torch.Tensor, settings: SamplingSettings):
        """Re-score window step `step[i]` of sample i (a [B] index tensor)."""
        text = self.model.encode_prompts(micro["prompts"])
        negative = (self.model.encode_prompts([self.cfg.rollout.negative_prompt] * len(micro))
                    if settings.guidance_scale != 1.0 else None)
        device = self.model.device
        rows = torch.arange(len(micro))
        return step_with_log_prob(
            self.model, text, negative,
            micro["latents"][rows, step].to(device),
            micro["sigmas"][rows, step].to(device),
            micro["sigmas_next"][rows, step].to(device),
            settings,
            sigma_max_next=micro.info["sigma_max_next"],
            x_next=micro["latents"][rows, step + 1].to(device),
        )

    @staticmethod
    def _train_steps(micro: Batch) -> torch.Tensor:
        """[B, K] window-step indices to train: `train_step_index` if given, else all W in order."""
        if "train_step_index" in micro:
            return micro["train_step_index"].long()
        return torch.arange(micro["sigmas"].shape[1]).unsqueeze(0).expand(len(micro), -1)

    @torch.no_grad()
    def score(self, batch: Batch, policy: str = "current") -> Batch:
        """Log-probs [B, W] and step means [B, W, *latent] of the stored transitions under
        `policy`: a Batch with `ref_log_probs` / `ref_means` for the reference policy and
        `old_log_probs` / `old_means` otherwise (the decoupled re-score of the old policy)."""
        require_keys(f"score({policy})", ("latents", "sigmas", "sigmas_next", "prompts"), batch.keys())
        settings = SamplingSettings(**batch.info["sampling"])
        self.model.transformer.eval()
        log_probs, means = [], []
        with self._policy(policy):
            for micro in batch.split(max(1, self.cfg.actor.ppo_micro_batch_size)):
                lp, mu = [], []
                for step in range(micro["sigmas"].shape[1]):
                    out = self._step_outputs(micro, torch.full((len(micro),), step), settings)
                    lp.append(out.log_prob.cpu())
                    mu.append(out.mean.cpu())
                log_probs.append(torch.stack(lp, 1))
                means.append(torch.stack(mu, 1))
        prefix = "ref" if policy == "reference" else "old"
        return Batch({f"{prefix}_log_probs": torch.cat(log_probs), f"{prefix}_means": torch.cat(means)})

    # ------------------------------------------------------------------ update
    def _check_batch(self, batch: Batch) -> None:
        require_keys(f"loss `{self.loss.name}`", self.loss.batch_keys, batch.keys())
        if self.kl is not None:
            require_keys("loss `kl` (diffusion_loss.kl_coef > 0)", self.kl.batch_keys, batch.keys())

    def trainable_names(self) -> list[str]:
        return [n for n, p in self.model.transformer.named_parameters() if p.requires_grad]

    def counters(self) -> dict:
        return {"policy_version": self.policy_version, "update_calls": self.update_calls,
                "nonfinite_in_a_row": self.nonfinite_in_a_row}

    def set_counters(self, state: dict) -> None:
        self.policy_version = int(state["policy_version"])
        self.update_calls = int(state["update_calls"])
        self.nonfinite_in_a_row = int(state["nonfinite_in_a_row"])

    def update(self, batch: Batch) -> dict[str, float]:
        """PPO-style update: inner epochs x mini-batches; each mini-batch accumulates gradients
        over its micro-batches and every trained window step, then clips and steps AdamW.

        Old log-probs: `old_log_probs` (decoupled re-score) if present, else the rollout
        `log_probs` (bypass). While no optimizer step has happened since the batch was
        sampled, the current weights ARE the old policy, so the old log-prob is taken as the
        detached current one: the ratio of the first mini-batch is exactly 1 and numerical
        noise between rollout and training forwards cannot leak into it.
        """
        self._check_batch(batch)
        acfg = self.cfg.actor
        lcfg = self.cfg.diffusion_loss
        settings = SamplingSettings(**batch.info["sampling"])
        rollout_version = batch.info.get("policy_version", -1)
        old_key = "old_log_probs" if "old_log_probs" in batch else "log_probs"
        num_samples = len(batch)
        # The controller fixes the number of optimizer steps per epoch (it survives dropping
        # zero-advantage samples); without it, ppo_mini_batch_size counts images over all ranks.
        num_mini = int(batch.info.get("num_mini_batches") or 0) or max(
            1, (num_samples * self.data_parallel_size) // (acfg.ppo_mini_batch_size or num_samples * self.data_parallel_size))
        if num_samples % num_mini:
            raise ValueError(f"{num_samples} samples on this worker do not split into {num_mini} mini-batches")
        mini_size = num_samples // num_mini
        micro_size = max(1, acfg.ppo_micro_batch_size)
        num_steps = self._train_steps(batch).shape[1]
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.update_calls)
        self.update_calls += 1
        params = self.model.trainable_parameters()
        sums: dict[str, float] = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)

        def log(name: str, value, weight: int = 1) -> None:
            sums[name] += float(value) * weight
            counts[name] += weight

        self.model.transformer.train()
        for _epoch in range(acfg.ppo_epochs):
            order = torch.randperm(num_samples, generator=gen) if acfg.shuffle else torch.arange(num_samples)
            for mb_start in range(0, num_samples, mini_size):
                mini = batch.select(order[mb_start:mb_start + mini_size])
                on_policy = self.policy_version == rollout_version
                self.optimizer.zero_grad(set_to_none=True)
                loss_total = 0.0
                for micro in mini.split(micro_size):
                    weight = len(micro) / len(mini) / num_steps
                    steps = self._train_steps(micro)
                    for k in range(num_steps):
                        loss, metrics = self._step_loss(micro, steps[:, k], settings, old_key, on_policy)
                        (loss * weight).backward()
                        loss_total += float(loss.detach()) * weight
                        for name, value in metrics.items():
                            log(name, value, len(micro))
                self._optimizer_step(params, loss_total, log)
        self.model.transformer.eval()
        metrics = {name: sums[name] / counts[name] for name in sums}
        metrics["lr"] = self.lr_scheduler.get_last_lr()[0]
        metrics["policy_version"] = self.policy_version
        return metrics

    def _step_loss(self, micro: Batch, step: torch.Tensor, settings: SamplingSettings, old_key: str, on_policy: bool):
        device = self.model.device
        rows = torch.arange(len(micro))
        out = self._step_outputs(micro, step, settings)
        rollout_lp = micro["log_probs"][rows, step].to(device)
        inputs = {
            "log_prob": out.log_prob,
            "advantages": micro["advantages"].to(device).float(),
            "mean": out.mean,
            "std_dev_t": out.std_dev_t,
            "sqrt_dt": out.sqrt_dt,
            "noise_std": out.noise_std,
        }
        for batch_key, step_key in (("old_means", "old_mean"), ("ref_means", "ref_mean"),
                                    ("is_weights", "is_weights")):
            if batch_key in micro:
                inputs[step_key] = micro[batch_key][rows, step].to(device)
        if on_policy:
            # The current weights are the old policy: take its log-prob AND step mean from this
            # very forward, so rollout/training kernel drift cannot enter the ratio or the guard bias.
            inputs["old_log_prob"] = out.log_prob.detach()
            inputs["old_mean"] = out.mean.detach()
        else:
            inputs["old_log_prob"] = micro[old_key][rows, step].to(device)
        loss, metrics = self.loss(inputs, self.cfg.diffusion_loss)
        if self.kl is not None:
            kl, kl_metrics = self.kl(inputs, self.cfg.diffusion_loss)
            loss = loss + self.cfg.diffusion_loss.kl_coef * kl
            metrics.update(kl_metrics)
        # How far the training forward is from the rollout's log-prob (same weights when on-policy).
        if on_policy:
            metrics["rollout_logp_abs_diff"] = (out.log_prob.detach() - rollout_lp).abs().mean()
        return loss, metrics

    def _optimizer_step(self, params, loss_total: float, log) -> None:
        if self.grad_sync is not None:
            self.grad_sync(params)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.actor.max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: the norm is a DTensor over the shards
            grad_norm = grad_norm.full_tensor()
        if not (math.isfinite(loss_total) and torch.isfinite(grad_norm)):
            # Skip the step rather than poison the weights; too many in a row stops the run.
            self.optimizer.zero_grad(set_to_none=True)
            self.nonfinite_in_a_row += 1
            log("skipped_nonfinite", 1.0)
            if self.nonfinite_in_a_row >= self.cfg.actor.max_consecutive_nonfinite:
                raise FloatingPointError(
                    f"{self.nonfinite_in_a_row} consecutive updates had a non-finite loss or gradient "
                    f"(loss={loss_total}); lower actor.lr or check the reward scale"
                )
            return
        self.nonfinite_in_a_row = 0
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.policy_version += 1
        log("grad_norm", float(grad_norm))
        log("skipped_nonfinite", 0.0)
