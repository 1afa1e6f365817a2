"""Objectives: how a micro-batch becomes the inputs of a loss.

The engine's update loop is the same for every loss: mini-batches, micro-batches, one backward
per (micro-batch, group of sub-steps), one optimizer step per mini-batch. A group is one
sub-step unless the loss is a mean of per-sample-step terms (`steps_batchable`) and
`actor.window_steps_per_forward` asks for more: then the group's sample-steps sit side by side
in one forward. What a sub-step is, and which
forwards feed the loss, is the objective's business:

- `transition`: a sub-step is one trained window step of the stored SDE trajectory; the step
  is re-scored under the current weights (log-prob, step mean) and compared with the old
  policy (and, with a KL coefficient, the reference).
- `forward_process` (Diffusion-DPO, DiffusionNFT, AWM): a sub-step is one sampled
  timestep per sample; the clean sample x0 is noised with fresh noise, x_t = (1 - t) x0 + t eps,
  and the loss sees the velocity of the policy (with gradient) and, when it asks for them, of
  the reference (adapters disabled) and of the `old` adapter (both without gradient). Pairs
  (Diffusion-DPO) share their noise and timestep, and so do the samples of a prompt's group
  with `diffusion_loss.params.group_noise`. No guidance, as in the references.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pixelrl.algos.forward_process import (SHARED_TIMESTEP_SAMPLERS, draw_timesteps, flow_matching_error,
                                           rollout_policy)
from pixelrl.algos.distillation import distill_term
from pixelrl.algos.kl import KL_BATCH_KEYS, step_kl_to_reference
from pixelrl.algos.losses import REFERENCE_STEP_KEYS, kept_mean, require_keys
from pixelrl.core.batch import Batch
from pixelrl.core.registry import Registry
from pixelrl.core.seeding import derive_seed
from pixelrl.models.base import PromptEmbeds
from pixelrl.sampling.sde import mean_over_dims
from pixelrl.sampling.rollout import SamplingSettings


def group_indices(uids: list) -> torch.Tensor:
    """[B] index of each row's group (rows with equal uid), numbered in order of first appearance."""
    first: dict = {}
    return torch.tensor([first.setdefault(uid, len(first)) for uid in uids], dtype=torch.long)


def whole_group_order(uids: list, generator: torch.Generator | None) -> torch.Tensor:
    """Row order with each prompt group's rows together: the groups in a random order (in
    order of first appearance without a generator), each group's rows in batch order."""
    groups = group_indices(uids)
    count = int(groups.max()) + 1 if len(groups) else 0
    ranks = torch.randperm(count, generator=generator) if generator is not None else torch.arange(count)
    return torch.cat([torch.nonzero(groups == g).flatten() for g in ranks.tolist()]) if count else groups


def step_groups(num_steps: int, per_forward: int) -> list[list[int]]:
    """Steps 0..num_steps-1 in consecutive groups of `per_forward` (0 = one group of all)."""
    size = per_forward or num_steps
    return [list(range(start, min(num_steps, start + size))) for start in range(0, num_steps, max(1, size))]


def side_by_side(micro: Batch, steps: list[torch.Tensor]) -> tuple[Batch, torch.Tensor]:
    """The micro-batch repeated once per entry of `steps` (block j holds every sample, each at
    its step `steps[j][i]`), and the step index of each of its rows: one forward for them all."""
    wide = micro.select(torch.arange(len(micro)).repeat(len(steps))) if len(steps) > 1 else micro
    return wide, torch.cat(steps)


@dataclass
class UpdateContext:
    """What every sub-step of one update shares."""

    settings: SamplingSettings | None
    old_key: str  # batch key of the old log-probs: decoupled re-score or the rollout's
    on_policy: bool = True  # no optimizer step since the batch was sampled
    # trained sample-steps of the current mini-batch over those rollout correction kept: a kept
    # step's loss weight, so the mini-batch's loss is the mean over its kept steps (verl's mask)
    kept_scale: float = 1.0


# method family (algos.methods.METHODS) -> how the engine trains its losses: an Objective subclass
OBJECTIVES: Registry = Registry("engine objective", "algorithm.trainer_type")


def register_objective(cls: type) -> type:
    """Register an objective class under its `name`, the method family it trains."""
    OBJECTIVES.register(cls.name)(cls)
    return cls


class Objective:
    """What every objective offers the engine. The policy is the engine's trained role; an
    objective that trains more roles (DMD2's fake score) adds their adapters and learners and
    names them for checkpoints. The single-network objectives keep these defaults."""

    name = ""

    def __init__(self, engine):
        self.engine = engine

    def add_adapters(self) -> None:
        """Add the other trained roles' adapters (before data parallelism wraps the model)."""

    def build_learners(self, trains: bool) -> None:
        """Build the other trained roles' optimizers (after the policy's)."""

    def extra_roles(self) -> dict:
        """{role: (its parameter names, its Learner)} of the trained roles besides the policy."""
        return {}

    def role_counters(self) -> dict:
        return {}

    def set_role_counters(self, state: dict) -> None:
        """Take `role_counters()` back from a checkpoint."""


@register_objective
class TransitionObjective(Objective):
    name = "transition"

    def check_batch(self, batch: Batch) -> None:
        e = self.engine
        require_keys(f"loss `{e.loss.name}`", e.loss.batch_keys, batch.keys())
        if e.cfg.diffusion_loss.kl_coef > 0:
            require_keys("the KL term (diffusion_loss.kl_coef > 0)", KL_BATCH_KEYS, batch.keys())

    def context(self, batch: Batch) -> UpdateContext:
        return UpdateContext(SamplingSettings(**batch.info["sampling"]),
                             "old_log_probs" if "old_log_probs" in batch else "log_probs")

    def before_update(self, batch: Batch, ctx: UpdateContext, optimizer_steps: int) -> None:
        """The rollout's log-probs are the old policy's: nothing to score before training."""

    def start_mini_batch(self, mini: Batch, ctx: UpdateContext) -> None:
        """With rollout-correction rejection (`step_mask`), the loss of this mini-batch is the mean
        over the sample-steps it keeps: each kept step weighs trained / kept."""
        if "step_mask" in mini:
            kept = mini["step_mask"].gather(1, self.trained_steps(mini))
            ctx.kept_scale = kept.numel() / max(float(kept.sum()), 1.0)

    @staticmethod
    def trained_steps(micro: Batch) -> torch.Tensor:
        """[B, K] window-step indices to train: `train_step_index` if given, else all W in order."""
        if "train_step_index" in micro:
            return micro["train_step_index"].long()
        return torch.arange(micro["sigmas"].shape[1]).unsqueeze(0).expand(len(micro), -1)

    def num_substeps(self, batch: Batch) -> int:
        return self.trained_steps(batch).shape[1]

    def substeps_loss(self, micro: Batch, ks: list[int], ctx: UpdateContext):
        """The loss of sub-steps `ks` of every sample in one forward: with several, the
        micro-batch is repeated once per sub-step (rows k-major), each row at its own step."""
        e = self.engine
        device = e.model.device
        trained = self.trained_steps(micro)
        micro, step = side_by_side(micro, [trained[:, k] for k in ks])
        rows = torch.arange(len(micro))
        out = e.step_outputs(micro, step, ctx.settings)
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
                                    ("teacher_means", "teacher_mean"), ("is_weights", "is_weights")):
            if batch_key in micro:
                inputs[step_key] = micro[batch_key][rows, step].to(device)
        if "step_mask" in micro:  # a rejected step weighs 0; a kept one trained / kept of the mini-batch
            inputs["step_mask"] = micro["step_mask"][rows, step].to(device).float() * ctx.kept_scale
            inputs["is_weights"] = inputs.get("is_weights", 1.0) * inputs["step_mask"]
        if ctx.on_policy:
            # The current weights are the old policy: take its log-prob AND step mean from this
            # very forward, so rollout/training kernel drift cannot enter the ratio or the guard bias.
            inputs["old_log_prob"] = out.log_prob.detach()
            inputs["old_mean"] = out.mean.detach()
        else:
            inputs["old_log_prob"] = micro[ctx.old_key][rows, step].to(device)
        loss, metrics = e.loss(inputs, e.loss_options)
        lcfg = e.cfg.diffusion_loss
        if lcfg.kl_coef > 0:
            kl, kl_metrics = step_kl_to_reference(inputs, lcfg.kl_type)
            loss = loss + lcfg.kl_coef * kl
            metrics.update(kl_metrics)
        if lcfg.distill_coef > 0:  # on-policy distillation beside the policy loss
            term, metrics["distill_kl"] = distill_term(inputs, lcfg.distill_variance)
            loss = loss + lcfg.distill_coef * term
        # How far the training forward is from the rollout's log-prob (same weights when on-policy).
        if ctx.on_policy:
            metrics["rollout_logp_abs_diff"] = kept_mean((out.log_prob.detach() - rollout_lp).abs(),
                                                         inputs.get("step_mask"))
        return loss, metrics


@register_objective
class ForwardProcessObjective(Objective):
    name = "forward_process"

    def __init__(self, engine):
        self.engine = engine
        from diffusers import FlowMatchEulerDiscreteScheduler

        # the 1000-step training schedule as `from_pretrained` builds it (shift applied)
        self.train_sigmas = FlowMatchEulerDiscreteScheduler.from_config(engine.model.scheduler.config).sigmas.float()

    def check_batch(self, batch: Batch) -> None:
        group = ("uids",) if getattr(self.engine.loss_options, "group_noise", False) else ()
        require_keys(f"loss `{self.engine.loss.name}`", (*self.engine.loss.batch_keys, "prompts", *group), batch.keys())

    def context(self, batch: Batch) -> UpdateContext:
        """Draw every sample's timesteps and noises for this update. Each draw comes from a stream
        of its own, keyed by the engine seed, the update count and the row's `draw_label` (the
        controller labels the rows of the whole step's batch before it is split over workers), so
        rows on every worker draw independently, the draws do not depend on the worker split, and a
        resumed run draws the same ones. Shared draws share a key: a prompt group's rows
        (`group_noise`, keyed by `draw_group`), `samples_per_timestep_draw` rows' timesteps (AWM's
        reference count), and DGPO's timesteps (one draw for the whole update, by design)."""
        e, opts = self.engine, self.engine.loss_options
        update_seed = derive_seed(e.cfg.seed * 1_000_003 + e.update_calls, "flow_matching")
        labels = batch["draw_label"].long() if "draw_label" in batch else torch.arange(len(batch))
        group_noise = getattr(opts, "group_noise", False)
        noise_keys = (batch["draw_group"].long() if "draw_group" in batch else group_indices(batch["uids"])) \
            if group_noise else labels
        time_keys = noise_keys if group_noise else labels // getattr(opts, "samples_per_timestep_draw", 1)

        def draw_times(generator: torch.Generator, rows: int) -> torch.Tensor:
            return draw_timesteps(opts.timesteps, rows, grid=e.sigmas[:-1], train_sigmas=self.train_sigmas,
                                  generator=generator, num_timesteps=getattr(opts, "num_timesteps", 1),
                                  fraction=getattr(opts, "timestep_fraction", 1.0),
                                  time_shift=getattr(opts, "time_shift", 3.0),
                                  max_index=getattr(opts, "max_timestep_index", None),
                                  min_sigma=getattr(opts, "min_sigma", 0.0))

        def stream(name: str, key: int) -> torch.Generator:
            return torch.Generator().manual_seed(derive_seed(update_seed, f"{name} {key}"))

        if opts.timesteps in SHARED_TIMESTEP_SAMPLERS:  # one draw for every row of every worker
            t = draw_times(torch.Generator().manual_seed(update_seed), len(batch))
        else:
            by_key = {key: draw_times(stream("timesteps", key), 1)[0] for key in time_keys.unique().tolist()}
            t = torch.stack([by_key[key] for key in time_keys.tolist()]) if len(batch) else \
                torch.empty(0, getattr(opts, "num_timesteps", 1))
        x0 = batch["x0"]
        noise = {key: torch.randn((t.shape[1], *x0.shape[1:]), generator=stream("noise", key))
                 for key in noise_keys.unique().tolist()}
        batch["fm_t"] = t
        batch["fm_eps"] = torch.stack([noise[key] for key in noise_keys.tolist()]) if len(batch) else \
            torch.empty(0, t.shape[1], *x0.shape[1:])
        return UpdateContext(None, "")

    def num_substeps(self, batch: Batch) -> int:
        return batch["fm_t"].shape[1]

    def _noised(self, micro: Batch, k: int):
        """Timestep k of every sample: (clean samples, t, eps, x_t, a velocity function of x_t)."""
        e = self.engine
        device = e.model.device
        text = e.model.encode_conditions(micro["prompts"], micro.get("condition_images"))
        t = micro["fm_t"][:, k].to(device)
        eps = micro["fm_eps"][:, k].to(device)
        t_ = t.reshape(-1, *([1] * (eps.ndim - 1)))
        clean = [micro["x0"].to(device)] + ([micro["x0_rejected"].to(device)] if "x0_rejected" in micro else [])
        x_t = torch.cat([(1 - t_) * x0 + t_ * eps for x0 in clean])
        times, cond = t.repeat(len(clean)), PromptEmbeds.cat([text] * len(clean))

        def velocity():
            # the conditional velocity; a guidance-distilled family (guidance is a denoiser input) gets the
            # sampling scale, as the rollouts had it (a CFG family's scale needs a negative branch)
            return e.model.predict_velocity(x_t, times, cond, guidance_scale=e.cfg.rollout.guidance_scale)

        return clean, t, eps, x_t, velocity

    def _samples_from_old_policy(self) -> bool:
        return rollout_policy(self.engine.loss_options) == "old"

    def start_mini_batch(self, mini: Batch, ctx: UpdateContext) -> None:
        """Nothing to prepare: every drawn (t, eps) trains."""

    def before_update(self, batch: Batch, ctx: UpdateContext, optimizer_steps: int) -> None:
        """A loss with an off-policy ratio (AWM's `clip_range`) needs the old policy's error at
        every drawn (t, eps) whenever some optimizer step will not be on-policy: after the first
        step of the update, on a stale batch, or when the samples came from the `old` adapter (the
        AWM reference's off_policy mode). Scored here, before any step, without gradient; the
        reference does the same pass (train_sd3_awm.py, `old_log_probs`)."""
        e = self.engine
        if getattr(e.loss_options, "clip_range", None) is None:
            return
        if optimizer_steps <= 1 and ctx.on_policy and not self._samples_from_old_policy():
            return
        old_errors = []
        with torch.no_grad(), e.policy("old" if self._samples_from_old_policy() else "current"):
            for micro in batch.split(max(1, e.cfg.actor.ppo_micro_batch_size)):
                per_k = []
                for k in range(self.num_substeps(batch)):
                    clean, _, eps, _, velocity = self._noised(micro, k)
                    per_k.append(flow_matching_error(velocity(), eps, clean[0]).cpu())
                old_errors.append(torch.stack(per_k, dim=1))
        batch["fm_old_err"] = torch.cat(old_errors)

    def substeps_loss(self, micro: Batch, ks: list[int], ctx: UpdateContext):
        (k,) = ks  # config validation keeps forward-process losses at one sub-step per forward
        e = self.engine
        device = e.model.device
        needs = set(e.loss.step_keys_needed(e.loss_options))
        clean, t, eps, x_t, velocity = self._noised(micro, k)
        v = velocity()
        with torch.no_grad():
            v_ref = v_old = None
            if needs & REFERENCE_STEP_KEYS:
                with e.policy("reference"):
                    v_ref = velocity()
            if "v_old" in needs:
                with e.policy("old"):
                    v_old = velocity()
        target = torch.cat([eps - x0 for x0 in clean])
        if "x0_rejected" in micro:  # a pair: errors of the chosen and rejected halves
            err = mean_over_dims((v - target) ** 2)
            ref_err = mean_over_dims((v_ref - target) ** 2)
            b = len(micro)
            inputs = {"err_chosen": err[:b], "err_rejected": err[b:], "ref_err_chosen": ref_err[:b],
                      "ref_err_rejected": ref_err[b:]}
        else:
            inputs = {"x0": clean[0], "x_t": x_t, "t": t, "eps": eps, "v": v, "v_ref": v_ref, "v_old": v_old}
            if "advantages" in micro:  # supervised fine-tuning's demonstrations carry none
                inputs["advantages"] = micro["advantages"].to(device).float()
            if e.loss.whole_groups:  # the micro-batch's prompt groups, whole (the engine keeps them so)
                inputs["groups"] = group_indices(micro["uids"]).to(device)
                inputs["num_groups"] = len(set(micro["uids"]))
            # off-policy: the old policy's error scored before the update; on-policy the current
            # forward is the old policy, and the loss takes it detached (a ratio of exactly 1)
            if "fm_old_err" in micro and (not ctx.on_policy or self._samples_from_old_policy()):
                inputs["err_old"] = micro["fm_old_err"][:, k].to(device)
        return e.loss(inputs, e.loss_options)


@register_objective
class SupervisedObjective(ForwardProcessObjective):
    """Supervised fine-tuning's: the forward process on a dataset's targets (`algos.supervised`),
    drawn and trained as the forward-process methods train their samples."""
    name = "supervised"
