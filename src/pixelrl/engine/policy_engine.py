"""`PolicyEngine`: one diffusion model, its optimizer and adapters; rollout, score, update.

The engine is what a worker runs. It knows nothing about Ray or about other workers except
through the `Mesh` it is given (`pixelrl.parallel`: the denoiser replicated or sharded before
the optimizer exists, every trained role's gradients reduced through its learner's `grad_sync`).
"""

from __future__ import annotations

import contextlib
import copy
from collections import defaultdict

import torch

from pixelrl.algos.losses import get_loss, require_keys
from pixelrl.engine.flops import FlopMeter, matmul_peak_flops, peak_memory_gb
from pixelrl.engine.learner import Learner, kept_on_device
from pixelrl.engine import distribution_matching  # noqa: F401  (registers its objective)
from pixelrl.engine.objectives import OBJECTIVES, side_by_side, step_groups, whole_group_order
from pixelrl.engine.weights_ema import WeightsEMA
from pixelrl.engine.checkpoint import teacher_weights
from pixelrl.engine.teachers import add_teacher_adapter, holding_teacher, score_by_teacher
from pixelrl.core.batch import Batch
from pixelrl.engine.config import EngineConfig, actor_optimizer_steps
from pixelrl.core.errors import ConfigError
from pixelrl.models.base import DiffusionModel
from pixelrl.parallel.fsdp import parallelize_denoiser
from pixelrl.parallel.group import Mesh
from pixelrl.algos.distillation import BASE_TEACHER, teacher_routes
from pixelrl.algos.forward_process import old_policy_decay, rollout_policy
from pixelrl.models.lora import adapter_active, adapters_disabled, add_adapter_copy, add_lora, blend_adapter
from pixelrl.sampling.rollout import SamplingSettings, rollout, step_with_log_prob
from pixelrl.sampling.schedule import schedule_sigmas
from pixelrl.sampling.windows import Window, full_window

POLICIES = ("current", "old", "reference", "ema")


class PolicyEngine:
    """`trains=False` builds a rollout-only engine (a separate rollout pool's worker): the same
    model and adapters, no optimizer; it receives weights with `load_weights`. `cfg` is the run's
    config (pixelrl.config.PixelRLConfig): the engine's sections, plus the data and trainer
    sections the learning-rate schedule's length is counted from."""

    def __init__(self, model: DiffusionModel, cfg: EngineConfig, trains: bool = True, mesh: Mesh | None = None):
        self.model = model
        # this rank's place among the ranks sharing each optimizer step; `actor.ppo_mini_batch_size`
        # counts images over all data ranks
        self.mesh = mesh or Mesh()
        self.cfg = cfg
        self.loss = get_loss(cfg.diffusion_loss.name)
        self.loss_options = self.loss.bind(cfg.diffusion_loss)
        self.objective = OBJECTIVES.get(self.loss.objective)(self)
        self.settings = SamplingSettings(
            noise_level=cfg.rollout.noise_level,
            sde_type=cfg.rollout.sde_type,
            guidance_scale=cfg.rollout.guidance_scale,
            logprob_reduction=cfg.rollout.logprob_reduction,
            solver=cfg.rollout.solver,
            accelerator=cfg.rollout.accelerator,
            accelerator_params=dict(cfg.rollout.accelerator_params),
        )
        self.sigmas = self.schedule(cfg.rollout.num_steps)

        mcfg = cfg.model
        torch.manual_seed(cfg.seed)
        self.use_lora = mcfg.lora_rank > 0
        self._frozen_reference = None
        # on-policy distillation's teachers: their specs by data_source, and each distinct one's
        # weights by the policy name it computes under (teacher_<i>)
        # (held where they are replayed: on the actor, or with rollout.scores_teacher on the rollout pool)
        replays_teacher = self.loss.reads_teacher(self.loss_options) and trains != cfg.rollout.scores_teacher
        routes = teacher_routes(self.loss_options.teacher) if replays_teacher else {}
        teachers = {spec: teacher_weights(spec) for spec in dict.fromkeys(routes.values())}
        names = {spec: f"teacher_{i}" for i, spec in enumerate(s for s, w in teachers.items() if w is not None)}
        # a whole-denoiser teacher is a frozen copy of the base with its weights, taken before
        # any adapter exists (its parameter names are the base's)
        self._full_teachers = {names[spec]: holding_teacher(self._reference_copy(), weights, spec)
                               for spec, weights in teachers.items() if weights is not None and weights.kind == "full"}
        # DiffusionNFT's old policy / AWM's EMA: a second, frozen adapter that starts as a copy,
        # kept when the loss reads it under these options (AWM's ema_beta > 0) or rollouts sample it
        self.has_old_adapter = self.use_lora and ("v_old" in self.loss.step_keys_needed(self.loss_options)
                                                  or rollout_policy(self.loss_options) == "old")
        if self.use_lora:
            targets = mcfg.lora_target_modules or model.default_lora_targets
            add_lora(model.transformer, rank=mcfg.lora_rank, alpha=mcfg.lora_alpha,
                     target_modules=targets, init=mcfg.lora_init)
            if self.has_old_adapter:
                add_adapter_copy(model.transformer, "old")
        else:
            model.keep_float32_master_weights()
            model.transformer.requires_grad_(True)
            if self.loss_reads_reference() or BASE_TEACHER in routes.values():
                # full fine-tuning keeps a frozen copy as the reference, taken now: a copy taken at
                # its first use would hold a resumed checkpoint's weights, not the base model's
                self._frozen_reference = self._reference_copy()
        for spec, weights in teachers.items():
            if weights is not None and weights.kind == "lora":  # a frozen adapter beside the student's
                add_teacher_adapter(model.transformer, names[spec], weights, spec)
        # each data_source's teacher: a policy name, or None for `base` (adapters off, or the frozen copy)
        self.teacher_of_source: dict[str, str | None] = {source: names.get(spec) for source, spec in routes.items()}
        self.objective.add_adapters()  # the other trained roles' (DMD2's fake score)
        if mcfg.gradient_checkpointing:
            model.transformer.enable_gradient_checkpointing()
        if not model.trainable_parameters():
            raise ConfigError("model.lora_target_modules", mcfg.lora_target_modules, "no parameter is trainable")
        if self.mesh.distributed:  # replicated or sharded before the optimizer exists
            parallelize_denoiser(model, self.mesh)
        # model FLOPs of every denoiser forward (sampling, reference, training): perf/mfu
        self._computing = "current"  # the policy `policy()` has switched to
        self.flop_meter = FlopMeter(model.transformer, *self._frozen_denoisers(), variant=lambda: self._computing)
        if mcfg.compiles() and self.mesh.sequence_size == 1:  # a split's collectives stay eager
            # Each repeated block, not the whole forward: the blocks hold nearly all the work and
            # the small kernels between matmuls (modulation, gates, residuals, norms) that
            # compiling fuses; one block structure compiles once and serves every block of it,
            # where the whole forward recompiled per input shape for minutes. Forwards only, not
            # module calls: hooks (the FLOP meter, FSDP2's) stay eager, parameter names stay.
            import torch._dynamo as dynamo

            from pixelrl.parallel.fsdp import no_split_units

            # every block of a family shares one forward's code: its variants (block structures x
            # adapter on / off / old x grad or not x a fixed then a dynamic batch) pass dynamo's
            # default limit of 8 per code, past which it would quietly run the rest eager
            dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 64)
            for denoiser in [model.transformer, *self._frozen_denoisers()]:
                for block in no_split_units(denoiser):
                    self.flop_meter.compile_forward(block)
        # The optimizer side (AdamW, warm-up, clipping, non-finite policy, DDP grad-sync hook).
        # A cosine lr decays over the run's optimizer steps (a time budget that stops it early leaves
        # the lr where it got to).
        self.learner = Learner.from_actor_config(model.trainable_parameters, cfg.actor,
                                                 total_steps=actor_optimizer_steps(cfg)) if trains else None
        self.objective.build_learners(trains)
        # the EMA of the trained weights that validation scores and checkpoints carry (actor.ema_decay)
        self.weights_ema = (WeightsEMA(model.trainable_parameters(), cfg.actor.ema_decay, cfg.actor.ema_update_interval,
                                       cfg.actor.ema_warmup)
                            if trains and cfg.actor.ema_decay > 0 else None)
        # Counts optimizer steps; a batch remembers the version that sampled it, so the engine
        # knows when the current weights ARE the rollout policy.
        self.policy_version = 0
        self.update_calls = 0
        if self.mesh.syncs_gradients and self.learner is not None:
            for learner in self.learners():  # every trained role's gradients are reduced
                learner.grad_sync = self.mesh.grad_sync

    def loss_reads_reference(self) -> bool:
        """The KL term, or a step key of the loss that a reference forward computes."""
        return self.loss.reads_reference(self.loss_options)

    @classmethod
    def from_config(cls, cfg: EngineConfig, trains: bool = True, mesh: Mesh | None = None) -> "PolicyEngine":
        """Load `cfg.model` and build the engine around it (no Ray); with a distributed `mesh`, the
        denoiser is replicated or sharded across its process group once its adapters exist."""
        from pixelrl.models.loader import load_configured_model

        return cls(load_configured_model(cfg.model), cfg, trains, mesh)

    def schedule(self, num_steps: int, size: tuple[int, int] | None = None) -> torch.Tensor:
        """The N + 1 sigmas of `rollout.sigma_schedule` at the rollout resolution, or at `size`
        (height, width: a family's grid shifts with the token count)."""
        res = self.cfg.rollout.resolution
        height, width = size or (res, res)
        return schedule_sigmas(self.model, num_steps, self.cfg.rollout.sigma_schedule, height, width,
                               self.cfg.rollout.sigma_shift)

    def output_size(self, condition_images: list | None) -> tuple[int, int]:
        """(height, width) a rollout call samples at: rollout.resolution square, or with
        rollout.output_aspect=source its rows' source aspect at about that many pixels (the
        loader and validation give a call rows of one source size)."""
        res = self.cfg.rollout.resolution
        if self.cfg.rollout.output_aspect != "source" or not condition_images:
            return res, res
        shapes = {tuple(row[self.model.aspect_source_index].shape[:2]) for row in condition_images}
        if len(shapes) > 1:
            raise ValueError(f"a rollout call samples one size, and its rows' sources are {sorted(shapes)} (height, "
                             "width): call it once per size")
        (height, width), = shapes
        return self.model.edit_output_size(res, width, height)

    # ------------------------------------------------------------------ rollout
    @property
    def stores_old_means(self) -> bool:
        return "old_means" in self.loss.batch_keys

    def default_window(self) -> Window:
        return full_window(self.cfg.rollout.num_steps)

    def rollout(self, prompts: list[str], seeds: list[int], *, window: Window | None = None,
                settings: SamplingSettings | None = None, num_steps: int | None = None,
                noise_seeds: list[int] | None = None, policy: str = "current",
                condition_images: list | None = None) -> Batch:
        """Sample one image per (prompt, seed) with `policy` (current or old), in micro-batches;
        an edit family's condition images per row (`condition_images`) are kept in the batch, so
        every later forward on these samples sees the rollout's exact input."""
        with self.policy(policy):
            return self._rollout(prompts, seeds, window=window, settings=settings, num_steps=num_steps,
                                 noise_seeds=noise_seeds, condition_images=condition_images)

    def conditions(self, micro: Batch, guidance_scale: float) -> tuple:
        """(condition, negative) embeddings of a batch's rows: their prompts and, when the batch
        holds them, their condition images."""
        images = micro.get("condition_images")
        return (self.model.encode_conditions(micro["prompts"], images),
                self.model.negative_embeds(self.cfg.rollout.negative_prompt, len(micro), guidance_scale, images))

    def _rollout(self, prompts, seeds, *, window, settings, num_steps, noise_seeds, condition_images) -> Batch:
        settings = settings or self.settings
        height, width = self.output_size(condition_images)
        square = (height, width) == (self.cfg.rollout.resolution,) * 2
        sigmas = (self.sigmas if num_steps is None and square
                  else self.schedule(num_steps or self.cfg.rollout.num_steps, (height, width)))
        window = window or (self.default_window() if num_steps is None else full_window(num_steps))
        if not settings.stores_transitions:
            window = Window(0, 0)  # no SDE step: no transition to store
        self.model.transformer.eval()
        chunks, accelerated = [], {}
        size = max(1, self.cfg.rollout.micro_batch_size)
        for start in range(0, len(prompts), size):
            out = rollout(
                self.model, prompts[start:start + size], seeds[start:start + size],
                sigmas=sigmas, window=window, settings=settings, height=height, width=width,
                negative_prompt=self.cfg.rollout.negative_prompt, store_means=self.stores_old_means,
                noise_seeds=None if noise_seeds is None else noise_seeds[start:start + size],
                condition_images=None if condition_images is None else condition_images[start:start + size],
            )
            tensors = {
                "images": out.images, "x0": out.final_latents.cpu(),  # x0: the clean sample, before decoding
                "latents": out.latents.cpu(), "log_probs": out.log_probs.cpu(),
                "sigmas": out.sigmas, "sigmas_next": out.sigmas_next,
                # schedule position of each stored column (windows differ between batches)
                "step_indices": torch.tensor(window.steps(), dtype=torch.long).expand(len(out.images), -1).clone(),
            }
            if out.means is not None:
                tensors["old_means"] = out.means.cpu()
            for name, count in out.accelerated.items():
                accelerated[name] = accelerated.get(name, 0) + count
            values = {"prompts": list(prompts[start:start + size]), "seeds": list(seeds[start:start + size])}
            if condition_images is not None:
                values["condition_images"] = list(condition_images[start:start + size])
            chunks.append(Batch(tensors, values))
        batch = Batch.concat(chunks)
        batch.info.update(
            policy_version=self.policy_version,
            window=(window.start, window.end),
            sampling=settings.as_dict(),
            sigma_max_next=float(sigmas[1]),
            accelerated=accelerated,  # the accelerator's counters summed over the micro-batches
        )
        return batch

    # ------------------------------------------------------------------ scoring
    @contextlib.contextmanager
    def policy(self, which: str):
        """Make `self.model` compute with the requested policy's weights for the duration.

        `current` is the weights as they are now; `old` is the `old` adapter when the loss keeps
        one, else the current weights (in a colocated engine the old policy of a transition loss
        is the current one before this step's update); `reference` is the base model: LoRA
        adapters disabled, or the frozen copy kept for full fine-tuning; `ema` is the EMA of the
        trained weights (actor.ema_decay), or the current weights when the engine keeps none;
        `teacher_<i>` is an on-policy distillation teacher's frozen adapter.
        """
        if which not in POLICIES and which not in self.teacher_of_source.values() and which not in self.other_roles():
            raise ValueError(f"policy must be one of {POLICIES}, got {which!r}")
        outer, self._computing = self._computing, which
        try:
            with self._weights_of(which):
                yield
        finally:
            self._computing = outer

    def other_roles(self) -> dict:
        """The trained roles besides the policy (DMD2's fake score), each an adapter of its name."""
        return self.objective.extra_roles()

    def _reference_copy(self) -> torch.nn.Module:
        """A frozen copy of the fully fine-tuned denoiser, in the compute dtype: it is never
        stepped, so it needs no float32 master weights."""
        return copy.deepcopy(self.model.transformer).to(self.model.dtype).requires_grad_(False).eval()

    def _frozen_denoisers(self) -> list[torch.nn.Module]:
        """The whole frozen denoisers beside the trained one: a full fine-tune's reference and
        whole-denoiser teachers."""
        return [*filter(None, [self._frozen_reference]), *self._full_teachers.values()]

    @contextlib.contextmanager
    def _weights_of(self, which: str):
        if which == "old" and self.has_old_adapter:
            with adapter_active(self.model.transformer, "old"):
                yield
        elif which in self._full_teachers:
            with self._denoiser_swapped(self._full_teachers[which]):
                yield
        elif which.startswith("teacher_") or which in self.other_roles():
            with adapter_active(self.model.transformer, which):
                yield
        elif which == "ema" and self.weights_ema is not None:
            with self.weights_ema.swapped_in():
                yield
        elif which != "reference":
            yield
        elif self.use_lora:
            with adapters_disabled(self.model.transformer):
                yield
        else:
            if self._frozen_reference is None:
                self._frozen_reference = self._reference_copy()
            with self._denoiser_swapped(self._frozen_reference):
                yield

    @contextlib.contextmanager
    def _denoiser_swapped(self, frozen: torch.nn.Module):
        """Compute with a frozen whole denoiser in the trained one's place for the duration."""
        trained = self.model.transformer
        self.model.transformer = frozen
        try:
            yield
        finally:
            self.model.transformer = trained

    def step_outputs(self, micro: Batch, step: torch.Tensor, settings: SamplingSettings):
        """Re-score window step `step[i]` of sample i (a [B] index tensor)."""
        text, negative = self.conditions(micro, settings.guidance_scale)
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

    @torch.no_grad()
    def score(self, batch: Batch, policy: str = "current") -> Batch:
        """Log-probs [B, W] and step means [B, W, *latent] of the stored transitions under
        `policy`: a Batch with `ref_log_probs` / `ref_means` for the reference policy,
        `teacher_log_probs` / `teacher_means` for a distillation teacher, and `old_log_probs` /
        `old_means` otherwise (the decoupled re-score of the old policy)."""
        require_keys(f"score({policy})", ("latents", "sigmas", "sigmas_next", "prompts"), batch.keys())
        settings = SamplingSettings(**batch.info["sampling"])
        self.model.transformer.eval()
        if policy == "teacher":
            return score_by_teacher(self, batch, settings)
        with self.policy(policy):
            log_probs, means = self.replay(batch, settings)
        prefix = "ref" if policy == "reference" else "old"
        return Batch({f"{prefix}_log_probs": log_probs, f"{prefix}_means": means})

    def replay(self, batch: Batch, settings: SamplingSettings) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs [B, W] and step means of every stored step under the weights in use."""
        log_probs, means = [], []
        for micro in batch.split(max(1, self.cfg.actor.ppo_micro_batch_size)):
            lp, mu = [], []
            for steps in step_groups(micro["sigmas"].shape[1], self.cfg.actor.window_steps_per_forward):
                wide, step = side_by_side(micro, [torch.full((len(micro),), s) for s in steps])
                out = self.step_outputs(wide, step, settings)
                lp.extend(out.log_prob.cpu().split(len(micro)))  # back to one chunk per step
                mu.extend(out.mean.cpu().split(len(micro)))
            log_probs.append(torch.stack(lp, 1))
            means.append(torch.stack(mu, 1))
        return torch.cat(log_probs), torch.cat(means)

    def teacher_of_rows(self, batch: Batch) -> list[str | None]:
        """Each row's distillation teacher: its data_source's (`*`'s for a source not named, and
        for a batch without sources); a policy name, or None for the base."""
        routes = self.teacher_of_source
        sources = batch["data_sources"] if "data_sources" in batch else ["*"] * len(batch)
        return [routes.get(source, routes["*"]) for source in sources]

    @torch.no_grad()
    def encode(self, batch: Batch) -> Batch:
        """Clean latents of given images (demonstrations, offline preference pairs): `x0` from
        `images` and, for a pair, `x0_rejected` from `images_rejected`, through the model's
        autoencoder when it has one."""
        require_keys("encode", ("images",), batch.keys())
        out = {}
        for source, target in (("images", "x0"), ("images_rejected", "x0_rejected")):
            if source not in batch:
                continue
            out[target] = torch.cat([self.model.encode(part[source]).cpu()
                                     for part in batch.split(max(1, self.cfg.rollout.micro_batch_size))])
        return Batch(out)

    # ------------------------------------------------------------------ update
    def trainable_names(self) -> list[str]:
        return [n for n, p in self.model.transformer.named_parameters() if p.requires_grad]

    def weights(self) -> dict[str, torch.Tensor]:
        """The trained weights as full CPU tensors (the LoRA state, or the whole denoiser)."""
        from pixelrl.parallel.state import full_trainable_state

        return full_trainable_state(self.model.transformer, self.trainable_names())

    def load_weights(self, state: dict[str, torch.Tensor], policy_version: int) -> None:
        """Take another engine's `weights()` and its version (weight sync to a rollout engine)."""
        from pixelrl.parallel.state import load_trainable_state

        names = set(self.trainable_names())
        if set(state) != names:
            raise ValueError(f"weight sync: expected {len(names)} tensors named like {sorted(names)[:2]}, "
                             f"got {len(state)} named like {sorted(state)[:2]}")
        load_trainable_state(self.model.transformer, state)
        self.policy_version = int(policy_version)

    def counters(self) -> dict:
        return {"policy_version": self.policy_version, "update_calls": self.update_calls,
                "nonfinite_in_a_row": self.learner.nonfinite_in_a_row if self.learner else 0,
                **({"roles": self.objective.role_counters()} if self.other_roles() and self.learner else {})}

    def set_counters(self, state: dict) -> None:
        self.policy_version = int(state["policy_version"])
        self.update_calls = int(state["update_calls"])
        self.learner.nonfinite_in_a_row = int(state["nonfinite_in_a_row"])
        if "roles" in state:
            self.objective.set_role_counters(state["roles"])

    def learners(self) -> list[Learner]:
        """Every trained role's optimizer side (the policy's first)."""
        return [self.learner, *(learner for _, learner in self.other_roles().values() if learner is not None)]

    def train_role(self, role: str, batch: Batch) -> dict[str, float]:
        """One attempt of a multi-role method's `role` on the batch (DMD2: `student` or `fake_score`)."""
        if self.learner is None:
            raise RuntimeError("a rollout-only engine (trains=False) does not train")
        if not hasattr(self.objective, "attempt"):
            raise RuntimeError(f"loss `{self.loss.name}` trains one role: use `update`")
        return self.objective.attempt(role, batch)

    def update(self, batch: Batch) -> dict[str, float]:
        """PPO-style update: inner epochs x mini-batches; each mini-batch accumulates gradients
        over its micro-batches and every sub-step of the loss's objective (trained window steps
        for transition losses), then takes one optimizer step.

        Transition losses: old log-probs are `old_log_probs` (decoupled re-score) if present,
        else the rollout `log_probs` (bypass). While no optimizer step has happened since the
        batch was sampled, the current weights ARE the old policy, so the old log-prob is taken
        as the detached current one: the ratio of the first mini-batch is exactly 1 and numerical
        noise between rollout and training forwards cannot leak into it.
        """
        if self.learner is None:
            raise RuntimeError("a rollout-only engine (trains=False) does not update")
        objective = self.objective
        objective.check_batch(batch)
        acfg = self.cfg.actor
        rollout_version = batch.info.get("policy_version", -1)
        num_samples = len(batch)
        # The controller fixes the number of optimizer steps per epoch (it survives dropping
        # zero-advantage samples); without it, ppo_mini_batch_size counts images over all ranks.
        num_mini = int(batch.info.get("num_mini_batches") or 0) or max(
            1, (num_samples * self.mesh.data_size) // (acfg.ppo_mini_batch_size or num_samples * self.mesh.data_size))
        if num_samples % num_mini:
            raise ValueError(f"{num_samples} samples on this worker do not split into {num_mini} mini-batches")
        mini_size = num_samples // num_mini
        micro_size = max(1, acfg.ppo_micro_batch_size)
        gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.update_calls)
        orders = []
        for _epoch in range(acfg.ppo_epochs):
            if self.loss.whole_groups:  # whole prompt groups, shuffled as units (DGPO's group sums)
                orders.append(whole_group_order(batch["uids"], gen if acfg.shuffle else None))
            else:
                orders.append(torch.randperm(num_samples, generator=gen) if acfg.shuffle else torch.arange(num_samples))
        ctx = objective.context(batch)
        ctx.on_policy = self.policy_version == rollout_version
        objective.before_update(batch, ctx, acfg.ppo_epochs * num_mini)
        num_substeps = objective.num_substeps(batch)
        groups = step_groups(num_substeps, acfg.window_steps_per_forward)
        self.update_calls += 1
        # sums stay on the device until the update ends: reading a scalar back inside the loop
        # would make the host wait for every micro-batch's kernels before launching the next
        sums: dict = defaultdict(float)
        counts: dict[str, int] = defaultdict(int)

        def log(name: str, value, weight: int = 1) -> None:
            sums[name] = sums[name] + kept_on_device(value) * weight
            counts[name] += weight

        self.model.transformer.train()
        for order in orders:
            for mb_start in range(0, num_samples, mini_size):
                mini = batch.select(order[mb_start:mb_start + mini_size])
                ctx.on_policy = self.policy_version == rollout_version
                objective.start_mini_batch(mini, ctx)
                self.learner.zero_grad()
                loss_total = 0.0
                for micro in mini.split(micro_size):
                    for ks in groups:  # a group's loss is the mean over its sample-steps
                        weight = len(micro) * len(ks) / len(mini) / num_substeps
                        loss, metrics = objective.substeps_loss(micro, ks, ctx)
                        if loss.requires_grad:  # not: steps computed by a frozen expert alone (no gradient)
                            (loss * weight).backward()
                        loss_total = loss_total + kept_on_device(loss) * weight
                        for name, value in metrics.items():
                            log(name, value, len(micro) * len(ks))
                step_metrics = self.learner.step(float(loss_total))  # the step waits for the gradients anyway
                if step_metrics.pop("stepped"):
                    self.policy_version += 1
                    decay = self.refresh_old_adapter("optimizer_step")
                    if decay is not None:
                        log("old_policy_decay", decay)
                    if self.weights_ema is not None:
                        decay = self.weights_ema.update(self.policy_version)
                        if decay is not None:
                            log("weights_ema_decay", decay)
                for name, value in step_metrics.items():
                    log(name, value)
        self.model.transformer.eval()
        metrics = {name: float(sums[name]) / counts[name] for name in sums}
        decay = self.refresh_old_adapter("update")
        if decay is not None:
            metrics["old_policy_decay"] = decay
        metrics["lr"] = self.learner.current_lr
        metrics["policy_version"] = self.policy_version
        metrics.update(self.flop_meter.take(self.peak_flops()))
        metrics["perf/peak_memory_gb"] = peak_memory_gb(next(self.model.transformer.parameters()).device)
        return metrics

    def refresh_old_adapter(self, unit: str) -> float | None:
        """Blend the `old` adapter towards the policy when `unit` (an update's end, or an optimizer
        step) is the loss's refresh unit and the interval is due; the decay it used, else None."""
        opts = self.loss_options
        if not self.has_old_adapter or opts.old_policy_refresh != unit:
            return None
        count = self.policy_version if unit == "optimizer_step" else self.update_calls
        if count % opts.old_policy_update_interval:
            return None
        if opts.old_policy_clock == "updates":
            step = self.update_calls - 1  # the updates before this one (Flow-Factory's epoch)
        else:
            step = self.policy_version - 1 if unit == "optimizer_step" else self.policy_version
        decay = old_policy_decay(opts.old_policy_schedule, step, opts.old_policy_decay)
        blend_adapter(self.model.transformer, "old", "default", decay)
        return decay

    def peak_flops(self) -> float:
        """The device's peak FLOP/s for MFU: trainer.peak_tflops, or a matmul measured here once."""
        if self.cfg.trainer.peak_tflops > 0:
            return self.cfg.trainer.peak_tflops * 1e12
        param = next(self.model.transformer.parameters())
        return matmul_peak_flops(param.device, param.dtype)
