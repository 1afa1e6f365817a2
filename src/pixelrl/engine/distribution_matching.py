"""The `distribution_matching` objective (DMD2): two trained roles on one base.

The `student` is the engine's policy: the `default` adapter, stepped by the engine's learner
(`actor.*`), exported, validated and EMA-averaged like any policy. The `fake_score` is a second
adapter, a copy of the student at start, with its own learner (`diffusion_loss.params.fake_score`
replaces actor.* fields), its own step counter and lr schedule. The teacher is frozen: the base
with adapters off, or a teacher LoRA (`diffusion_loss.teacher`, routed by data_source).

One attempt (`attempt(role, batch)`) samples the batch's prompts with the student up to the exit
index the driver drew, and takes at most one optimizer step of that role. Every draw comes from
the row's own seed, so an attempt does not depend on how rows split over workers or micro-batches.
While one role trains, only its adapter is active and trainable; a gradient found on the other
role's parameters after a backward is an error.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from pixelrl.algos.distribution_matching import (draw_score_sigmas, fake_score_loss, guided_velocity, noised,
                                                 update_cycle, x0_from_velocity)
from pixelrl.core.batch import Batch
from pixelrl.core.errors import ConfigError
from pixelrl.core.seeding import derive_seed, sample_generators
from pixelrl.engine.learner import Learner, kept_on_device
from pixelrl.engine.objectives import Objective, register_objective
from pixelrl.models.base import PromptEmbeds
from pixelrl.models.lora import activate_adapter, adapter_params, add_adapter_copy
from pixelrl.sampling.rollout import randn_tensor

FAKE_ADAPTER = "fake_score"


@register_objective
class DistributionMatchingObjective(Objective):
    name = "distribution_matching"

    def __init__(self, engine):
        super().__init__(engine)
        self.params = engine.loss_options
        self.fake_learner: Learner | None = None
        self.fake_names: list[str] = []
        self.fake_steps = 0  # the fake score's optimizer steps (the student's are the policy version)

    # ------------------------------------------------------------------ set-up (the engine calls these)
    def add_adapters(self) -> None:
        e = self.engine
        if not e.use_lora:
            raise ConfigError("model.lora_rank", 0, "DMD2 trains the student and the fake score as two LoRA adapters "
                              "on one base (the teacher is that base): set model.lora_rank > 0")
        add_adapter_copy(e.model.transformer, FAKE_ADAPTER)  # the fake score starts as the student
        # its parameters' names, once (FSDP2 keeps them): the engine asks for its roles at every policy switch
        self.fake_names = [n for n, _ in e.model.transformer.named_parameters()
                           if "lora_" in n and f".{FAKE_ADAPTER}." in n]

    def build_learners(self, trains: bool) -> None:
        if not trains:
            return
        from pixelrl.engine.config import actor_optimizer_steps

        e = self.engine
        acfg = dataclasses.replace(e.cfg.actor, **dict(self.params.fake_score))
        self.fake_learner = Learner.from_actor_config(self.fake_parameters, acfg,
                                                      total_steps=actor_optimizer_steps(e.cfg, role=FAKE_ADAPTER))

    def fake_parameters(self) -> list[torch.nn.Parameter]:
        return list(adapter_params(self.engine.model.transformer, FAKE_ADAPTER).values())

    def extra_roles(self) -> dict:
        """The trained roles besides the policy, for checkpoints: {name: (parameter names, learner, counters)}."""
        return {FAKE_ADAPTER: (self.fake_names, self.fake_learner)}

    def role_counters(self) -> dict:
        return {FAKE_ADAPTER: {"steps": self.fake_steps, "nonfinite_in_a_row": self.fake_learner.nonfinite_in_a_row}}

    def set_role_counters(self, state: dict) -> None:
        own = state[FAKE_ADAPTER]
        self.fake_steps = int(own["steps"])
        self.fake_learner.nonfinite_in_a_row = int(own["nonfinite_in_a_row"])

    def check_batch(self, batch: Batch) -> None:
        raise RuntimeError("a distribution-matching engine trains with `attempt(role, batch)`, not `update`")

    # ------------------------------------------------------------------ attempts
    @contextlib.contextmanager
    def fake_score_trained(self):
        """The fake score active and trainable (and nothing else) for the duration."""
        transformer = self.engine.model.transformer
        activate_adapter(transformer, FAKE_ADAPTER)
        for param in self.fake_learner.params:
            param.requires_grad_(True)
        try:
            yield
        finally:
            activate_adapter(transformer, "default")

    def attempt(self, role: str, batch: Batch) -> dict[str, float]:
        """One attempt of `role` on the batch's (prompt, seed) rows; `batch.info["exit_index"]` is
        the student's exit step. Returns the attempt's metrics, prefixed with the role."""
        if role not in update_cycle(self.params):
            raise ValueError(f"DMD2 trains the roles {sorted(set(update_cycle(self.params)))}, not {role!r}")
        e = self.engine
        student = role == "student"
        learner = e.learner if student else self.fake_learner
        exit_index = int(batch.info["exit_index"])
        sigmas = e.sigmas
        if not 0 <= exit_index < len(sigmas) - 1:
            raise ValueError(f"exit index {exit_index} is outside the student's {len(sigmas) - 1} steps")
        e.model.transformer.train()
        learner.zero_grad()
        sums: dict = {}
        loss_total = 0.0
        for micro in batch.split(max(1, e.cfg.actor.ppo_micro_batch_size)):
            weight = len(micro) / len(batch)
            if student:
                loss, metrics = self._student_loss(micro, sigmas, exit_index)
                (loss * weight).backward()
            else:
                # x_g is the student's sample, drawn before the fake adapter is switched in: the fake
                # score learns the student's distribution, not its own (both references sample x_g
                # with the generator)
                text = self._encode(micro)
                x_g = self._student_sample(micro, text, sigmas, exit_index, with_graph=False)
                # the backward inside: a leaf made frozen before it would take no gradient
                with self.fake_score_trained():
                    loss, metrics = self._fake_loss(micro, text, x_g)
                    (loss * weight).backward()
            self._refuse_cross_gradients(role)
            loss_total = loss_total + kept_on_device(loss) * weight
            for name, value in {"loss": loss, **metrics}.items():
                sums[name] = sums.get(name, 0.0) + kept_on_device(value) * weight
        if e.mesh.data_size > 1:  # every rank skips a non-finite attempt together, never only some
            from pixelrl.parallel.group import all_reduce_sum

            loss_total = all_reduce_sum(torch.as_tensor(loss_total, dtype=torch.float64)) / e.mesh.data_size
        step = learner.step(float(loss_total))
        e.model.transformer.eval()
        out = {f"{role}/{k}": float(v) for k, v in sums.items()}
        if step.pop("stepped"):
            if student:
                e.policy_version += 1
                if e.weights_ema is not None:
                    decay = e.weights_ema.update(e.policy_version)
                    if decay is not None:
                        out["student/weights_ema_decay"] = decay
            else:
                self.fake_steps += 1
        out.update({f"{role}/{k}": float(v) for k, v in step.items()})
        out[f"{role}/lr"] = learner.current_lr
        out[f"{role}/exit_index"] = float(exit_index)
        return out

    def _refuse_cross_gradients(self, role: str) -> None:
        other = self.fake_learner if role == "student" else self.engine.learner  # the other role's parameters
        if any(p.grad is not None for p in other.params):
            raise RuntimeError(f"a {role} attempt left gradients on the other role's adapter: the roles' parameter "
                               "sets must stay disjoint")

    def _encode(self, micro: Batch) -> PromptEmbeds:
        return self.engine.model.encode_conditions(micro["prompts"], micro.get("condition_images"))

    def _student_sample(self, micro: Batch, text: PromptEmbeds, sigmas: torch.Tensor, exit_index: int,
                        with_graph: bool) -> torch.Tensor:
        """x_g: the student's x0 estimate at the exit step, after Euler steps (no graph) from the rows'
        initial noise; the exit forward keeps its graph when `with_graph`."""
        model = self.engine.model
        n = len(micro)
        x = randn_tensor((n, *model.latent_shape(*self._resolution())), generator=sample_generators(micro["seeds"],
                         model.device), device=model.device, dtype=torch.float32)
        with torch.no_grad():
            for i in range(exit_index):
                v = model.predict_velocity(x, sigmas[i].expand(n), text)
                x = x + (sigmas[i + 1] - sigmas[i]).to(x) * v
        sigma = sigmas[exit_index].expand(n)
        with torch.set_grad_enabled(with_graph):
            return x0_from_velocity(x, sigma, model.predict_velocity(x, sigma, text))

    def _resolution(self) -> tuple[int, int]:
        res = self.engine.cfg.rollout.resolution
        return res, res

    def _score_noise(self, micro: Batch, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's score sigma and noise, from two streams of its own seed (`dmd2_score_sigma`,
        `dmd2_score_noise`): on one stream the noise's first draws would give the sigma away. An
        attempt replaying its step's rollout (`score_stream` k) draws the streams of its own k."""
        p = self.params
        low, high = p.score_sigma_range
        rows = [int(s) for s in micro["seeds"]]
        k = micro.info.get("score_stream")
        suffix = "" if k is None else f"/{int(k)}"
        sigma_seeds = [derive_seed(s, "dmd2_score_sigma" + suffix) for s in rows]
        noise_seeds = [derive_seed(s, "dmd2_score_noise" + suffix) for s in rows]
        sigma = torch.cat([draw_score_sigmas(1, torch.Generator().manual_seed(s), timesteps=p.score_timesteps,
                                             shift=p.shift, low=low, high=high) for s in sigma_seeds]).to(like.device)
        eps = randn_tensor(tuple(like.shape), generator=sample_generators(noise_seeds, like.device), device=like.device,
                           dtype=torch.float32)
        return sigma, eps

    def _student_loss(self, micro: Batch, sigmas: torch.Tensor, exit_index: int):
        e = self.engine
        model = e.model
        text = self._encode(micro)
        x_g = self._student_sample(micro, text, sigmas, exit_index, with_graph=True)
        sigma, eps = self._score_noise(micro, x_g)
        x_s = noised(x_g.detach(), sigma, eps)
        with torch.no_grad():
            x_real = x0_from_velocity(x_s, sigma, self._teacher_velocity(micro, x_s, sigma))
            with e.policy(FAKE_ADAPTER):
                x_fake = x0_from_velocity(x_s, sigma, model.predict_velocity(x_s, sigma, text))
        loss, metrics = e.loss({"x_g": x_g, "x_real": x_real, "x_fake": x_fake}, self.params)
        return loss, {**metrics, "score_sigma": sigma.mean()}

    def _fake_loss(self, micro: Batch, text: PromptEmbeds, x_g: torch.Tensor):
        """Flow matching of the (active, trainable) fake score on the student's detached sample x_g."""
        sigma, eps = self._score_noise(micro, x_g)
        x_s = noised(x_g, sigma, eps)
        v_fake = self.engine.model.predict_velocity(x_s, sigma, text)
        return fake_score_loss(v_fake, eps, x_g), {"score_sigma": sigma.mean()}

    def _teacher_velocity(self, micro: Batch, x_s: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """The frozen teacher's guided velocity at (x_s, sigma), each row under its data_source's
        teacher, both guidance branches in one forward."""
        e, p = self.engine, self.params
        teachers = e.teacher_of_rows(micro)
        out = torch.empty_like(x_s)
        for teacher in dict.fromkeys(teachers):
            rows = [i for i, t in enumerate(teachers) if t == teacher]
            images = micro.get("condition_images")
            images = None if images is None else [images[i] for i in rows]
            text = e.model.encode_conditions([micro["prompts"][i] for i in rows], images)
            negative = e.model.negative_embeds(e.cfg.rollout.negative_prompt, len(rows), p.teacher_guidance, images)
            x, s = x_s[rows], sigma[rows]
            with e.policy(teacher or "reference"):
                if negative is None:
                    out[rows] = e.model.predict_velocity(x, s, text)
                    continue
                v_pos, v_neg = e.model.predict_velocity(torch.cat([x, x]), torch.cat([s, s]),
                                                        PromptEmbeds.cat([text, negative])).chunk(2)
            out[rows] = guided_velocity(v_pos, v_neg, p.teacher_guidance, p.cfg_norm, e.model.guidance_token_patch)
        return out
