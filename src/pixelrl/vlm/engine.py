"""`VLMEngine`: a vision-language policy with its reference, critic, EMA and KL controller.

The producer half (`make_experience`) samples n responses per prompt, scores them, and computes
old / reference log-probs, values, advantages and returns without gradients; the consumer half
(`train_on`) replays that experience in shuffled mini-batches for `actor.ppo_epochs` epochs,
each mini-batch one optimizer step of the actor (after the critic warm-up) and of the critic,
gradients accumulated over micro-batches of `actor.ppo_micro_batch_size` sequences.
Every random choice is seeded by the step, so a run resumed from a checkpoint replays exactly.
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pixelrl.vlm import token_losses as T
from pixelrl.vlm.reward_shaping import RunningMoments, group_rows, informative_groups, overlong_penalty
from pixelrl.core.assets import resolve
from pixelrl.engine.config import actor_optimizer_steps
from pixelrl.core.seeding import derive_seed
from pixelrl.parallel.group import Mesh, all_reduce_sum
from pixelrl.parallel.state import copy_full_into, full_tensor, optimizer_state, set_optimizer_state
from pixelrl.engine.learner import Learner, kept_on_device
from pixelrl.engine.weights_ema import holding
from pixelrl.models.qwen_vl import QwenVLModel, TokenBatch, ValueModel
from pixelrl.rewards.multi import WeightedReward

SEQUENCE_ESTIMATORS = ("group_norm", "rloo", "reinforce_baseline")
TOKEN_ESTIMATORS = ("reinforce", "gae")


@dataclass
class Experience:
    batch: TokenBatch  # sequences with response_mask
    old_logp: torch.Tensor  # [B, R]
    advantages: torch.Tensor  # [B, R]
    policy_mask: torch.Tensor  # [B, R]: response_mask, or its entropy-selected part
    ref_logp: torch.Tensor | None = None
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    def select(self, rows: torch.Tensor) -> "Experience":
        pick = lambda x: None if x is None else x[rows]  # noqa: E731
        return replace(self, batch=self.batch.select(rows), old_logp=self.old_logp[rows],
                       advantages=self.advantages[rows], policy_mask=self.policy_mask[rows],
                       ref_logp=pick(self.ref_logp), values=pick(self.values), returns=pick(self.returns))

    def __len__(self) -> int:
        return len(self.batch)


class VLMEngine:
    def __init__(self, cfg):
        self.cfg, v = cfg, cfg.vlm
        self.policy = QwenVLModel(resolve(cfg.model.path), dtype=cfg.model.dtype, device=cfg.model.device,
                                  min_pixels=v.min_pixels, max_pixels=v.max_pixels)
        torch.manual_seed(cfg.seed)
        self.reference_module = None
        if cfg.model.lora_rank > 0:
            self.policy.add_lora(rank=cfg.model.lora_rank, alpha=cfg.model.lora_alpha,
                                 targets=cfg.model.lora_target_modules)
        else:
            self.policy.keep_float32_master_weights()
            self.policy.model.requires_grad_(True)
            if v.freeze_vision_tower:
                self.policy.vision_tower().requires_grad_(False)
            if v.kl_coef > 0:  # full fine-tuning: the reference is a frozen copy of the start, never stepped
                self.reference_module = copy.deepcopy(self.policy.model).to(self.policy.dtype).requires_grad_(False).eval()
        self.trainable = [p for p in self.policy.model.parameters() if p.requires_grad]
        self.actor_learner = Learner.from_actor_config(lambda: self.trainable, cfg.actor,
                                                       total_steps=actor_optimizer_steps(cfg, v.freezing_actor_steps))
        self.critic = None
        if v.estimator == "gae":
            self.critic = ValueModel(self.policy)
            # actor.*'s optimizer and schedule at the critic's lr (LightRFT's critic: its own lr,
            # the same scheduler); the critic also trains through vlm.freezing_actor_steps
            self.critic_learner = Learner.from_actor_config(lambda: list(self.critic.parameters()),
                                                            replace(cfg.actor, lr=v.critic_lr),
                                                            total_steps=actor_optimizer_steps(cfg))
        self.ema = [p.detach().clone() for p in self.trainable] if v.ema_decay > 0 else None
        self.kl_ctl = (T.AdaptiveKLController(v.kl_coef, v.kl_target, v.kl_horizon) if v.kl_target
                       else T.FixedKLController(v.kl_coef))
        # (the controller's input or None for the update's KL, the round's samples), applied after training
        self._round_kl: tuple[float | None, int] | None = None
        self.reward = WeightedReward.from_functions(cfg.reward.functions, cfg.reward.timeout_s)
        self.reward_moments = RunningMoments() if v.reward_running_norm else None  # saved with checkpoints
        self.mesh = Mesh()  # this rank among the ranks sharing each optimizer step (set by enable_data_parallel)
        self._ptx_rows = None  # vlm.ptx_files' rows, read at the first ptx loss

    def enable_data_parallel(self, mesh: Mesh) -> None:
        """Join the process group's ranks (already initialised): the same start weights, then either
        gradients averaged after each mini-batch (ddp) or actor and critic sharded (fsdp2). Each rank
        samples and scores its own prompts; whitening and the KL controller use all ranks' numbers."""
        from pixelrl.parallel.fsdp import shard_blocks
        from pixelrl.parallel.group import broadcast_parameters

        self.mesh = mesh
        modules = [self.policy.model] + ([self.critic] if self.critic is not None else [])
        for module in modules:
            broadcast_parameters(module)
        if mesh.strategy == "fsdp2":
            # all-gather units: each decoder layer and vision block, and the vision tower itself
            # (generation encodes the image before the first forward of the whole model)
            for root, inner, master in ((self.policy.model, self.policy.model.model, self.policy.float32_master_weights),
                                        *([(self.critic, self.critic.backbone, self.critic.float32_master_weights)]
                                          if self.critic is not None else [])):
                shard_blocks(root, [*inner.language_model.layers, *inner.visual.blocks, inner.visual],
                             self.policy.dtype if master else None)
            # every rank must run the same forwards: generation continues until all ranks are done
            self.policy.synced_generation = True
            # the parameters are DTensors now: the optimizers and the EMA follow them
            self.trainable = [p for p in self.policy.model.parameters() if p.requires_grad]
            self.actor_learner.rebuild()
            if self.critic is not None:
                self.critic_learner.rebuild()
            if self.ema is not None:
                self.ema = [p.detach().clone() for p in self.trainable]
        else:
            self.actor_learner.grad_sync = mesh.grad_sync
            if self.critic is not None:
                self.critic_learner.grad_sync = mesh.grad_sync

    def _whiten(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return T.masked_whiten(x, mask, all_reduce=all_reduce_sum if self.mesh.data_size > 1 else None)

    @contextlib.contextmanager
    def ema_weights(self):
        """The actor's trainable parameters hold their EMA inside the block (to validate the EMA
        actor) and get their own values back, bit for bit, when it ends."""
        with holding(self.trainable, self.ema):
            yield

    # --- helpers -------------------------------------------------------------------------
    def _micro(self, n: int):
        size = self.cfg.actor.ppo_micro_batch_size or n
        return [torch.arange(i, min(i + size, n)) for i in range(0, n, size)]

    @torch.no_grad()
    def _score_tokens(self, batch: TokenBatch, module=None, entropy=False):
        """Per-token log-probs (and entropies) of a whole batch, in micro-batches, no gradient."""
        parts = [self.policy.token_logprobs(batch.select(rows), temperature=self.cfg.vlm.temperature,
                                            module=module, with_entropy=entropy) for rows in self._micro(len(batch))]
        if entropy:
            return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        return torch.cat(parts)

    def _reference_logp(self, batch: TokenBatch) -> torch.Tensor:
        if self.reference_module is not None:
            return self._score_tokens(batch, module=self.reference_module)
        with self.policy.reference():
            return self._score_tokens(batch)

    # --- producer ------------------------------------------------------------------------
    def _sample_round(self, items: list[dict], seed: int, timing: dict) -> tuple[TokenBatch, dict]:
        """rollout.n responses to each item, scored (their rows consecutive per item)."""
        v = self.cfg.vlm
        clock = time.perf_counter()
        self.policy.model.eval()
        prompts = self.policy.prompts([it["image"] for it in items], [it["question"] for it in items])
        rows = torch.arange(len(items)).repeat_interleave(self.cfg.rollout.n)
        batch = self.policy.generate(prompts.select(rows), seed=seed, temperature=v.temperature, top_p=v.top_p,
                                     max_new_tokens=v.max_new_tokens)
        texts = self.policy.decode(batch)
        timing["timing_s/generate"] = timing.get("timing_s/generate", 0.0) + time.perf_counter() - clock
        clock = time.perf_counter()
        meta = [items[i] for i in rows.tolist()]
        scores = self.reward(texts, [m["question"] for m in meta], meta)
        timing["timing_s/reward"] = timing.get("timing_s/reward", 0.0) + time.perf_counter() - clock
        return batch, scores

    def _sampled_share(self, items: list[dict], step: int, more_items, timing: dict) -> tuple[TokenBatch, dict, dict]:
        """This rank's share of the step, sampled and scored. With vlm.dynamic_sampling_rounds, DAPO's
        filter: groups whose rewards all agree are dropped and further questions (`more_items(k)`,
        round k's) sampled, every rank for as long as any is short (their update shapes must
        match), at most that many rounds; a share still short is filled with dropped groups."""
        v, n, groups = self.cfg.vlm, self.cfg.rollout.n, len(items)
        seed = derive_seed(self.cfg.rollout.seed + step, "vlm_rollout")
        batch, scores = self._sample_round(items, seed, timing)
        if not v.dynamic_sampling_rounds:
            return batch, scores, {}
        picked, dropped, first_share, short = [], [], None, groups
        for done in range(1, v.dynamic_sampling_rounds + 1):
            if batch is not None:
                informative = informative_groups(scores["overall"], n)
                first_share = float(informative.float().mean()) if first_share is None else first_share
                kept = informative.nonzero().flatten()[:short]
                picked.append((batch, scores, group_rows(kept, n)))
                dropped.append((batch, scores, group_rows((~informative).nonzero().flatten(), n)))
                short -= len(kept)
            anywhere = all_reduce_sum(torch.tensor([float(short)], dtype=torch.float64))  # no-op in one process
            if float(anywhere) == 0 or done == v.dynamic_sampling_rounds:
                break
            batch = scores = None
            if short or self.policy.synced_generation:  # fsdp2: every rank's forwards, sampled or not
                batch, scores = self._sample_round(more_items(done), derive_seed(
                    self.cfg.rollout.seed + step, f"vlm_rollout round {done}"), timing)
        missing = short
        for b, sc, rows in dropped:  # what is still missing: dropped groups, in order
            take = rows[:missing * n]
            picked.append((b, sc, take))
            missing -= len(take) // n
        chosen = [(b, sc, rows) for b, sc, rows in picked if len(rows)]
        batch = TokenBatch.concat([b.select(rows) for b, _, rows in chosen], self.policy.pad_id)
        scores = {k: torch.cat([sc[k][rows] for _, sc, rows in chosen]) for k in chosen[0][1]}
        return batch, scores, {"dynamic_sampling/rounds": float(done), "dynamic_sampling/informative_share": first_share,
                               "dynamic_sampling/filled_groups": float(short)}

    def _processed_reward(self, reward: torch.Tensor, metrics: dict) -> torch.Tensor:
        """LightRFT's reward processing: the running normalisation, then the clip."""
        v = self.cfg.vlm
        if self.reward_moments is not None:
            self.reward_moments.update(reward, all_reduce_sum)  # every rank's rewards (a no-op in one process)
            reward = self.reward_moments.normalize(reward, v.reward_running_norm_minus_mean)
            metrics["critic/reward_running_std"] = self.reward_moments.std
        if v.reward_clip > 0:
            metrics["critic/reward_clip_frac"] = float((reward.abs() > v.reward_clip).float().mean())
            reward = reward.clamp(-v.reward_clip, v.reward_clip)
        return reward

    def make_experience(self, items: list[dict], step: int, more_items=None) -> tuple[Experience, dict]:
        """Sample, score and compute the advantages of this rank's share of step `step`;
        `more_items(k)`: round k's questions for vlm.dynamic_sampling_rounds."""
        cfg, v = self.cfg, self.cfg.vlm
        n = cfg.rollout.n
        timing: dict = {}
        batch, scores, sampling = self._sampled_share(items, step, more_items, timing)
        shaped: dict = {}
        clock = time.perf_counter()
        mask = batch.response_mask
        if v.recompute_old_logp:
            old_logp, entropy = self._score_tokens(batch, entropy=True)
        else:
            old_logp, entropy = batch.extra["rollout_logp"], batch.extra["rollout_entropy"]
        ref_logp = self._reference_logp(batch) if v.kl_coef > 0 else None
        kl = T.kl_estimate(old_logp, ref_logp, mask, v.kl_estimator) if ref_logp is not None else None
        beta_in_reward = self.kl_ctl.value if (kl is not None and v.kl_in_reward) else 0.0
        score = scores["overall"]
        if v.overlong_buffer:
            penalty = overlong_penalty(mask.sum(1), v.max_new_tokens, v.overlong_buffer, v.overlong_penalty)
            score = score + penalty
            shaped["response/overlong_penalty"] = float(penalty.mean())
            shaped["response/overlong_share"] = float((penalty < 0).float().mean())
        if v.estimator not in SEQUENCE_ESTIMATORS:  # a token estimator: the reward itself is processed
            score = self._processed_reward(score, shaped)
        values = returns = None
        if v.estimator == "gae":
            with torch.no_grad():
                values = torch.cat([self.critic(batch.select(r)) for r in self._micro(len(batch))])
            rewards = T.token_rewards(score, mask, kl, beta_in_reward)
            adv, returns = T.gae(rewards, values, mask, v.gamma, v.lam)
            adv = self._whiten(adv, mask)
        elif v.estimator == "reinforce":
            returns = T.discounted_returns(T.token_rewards(score, mask, kl, beta_in_reward), mask, v.gamma)
            adv = self._whiten(returns, mask)
        else:
            seq = self._processed_reward(T.sequence_baseline_advantages(score, n, v.estimator), shaped)
            adv = seq.unsqueeze(1) * mask
            if beta_in_reward:  # the KL part is a per-token return, not group-normalised
                adv = adv - T.discounted_returns(beta_in_reward * kl, mask, 1.0)
            if v.estimator != "group_norm":
                adv = self._whiten(adv, mask)
        adv = adv.clamp(-v.advantage_clamp, v.advantage_clamp) * mask
        timing["timing_s/score"] = time.perf_counter() - clock  # old / reference log-probs, values
        # the diffusion trainers' names: critic/rewards/mean (the weighted sum), critic/rewards/<name>/mean
        metrics = {"critic/rewards/mean" if k == "overall" else f"critic/rewards/{k}/mean": float(t.mean())
                   for k, t in scores.items()}
        metrics.update(timing)
        metrics.update(sampling)
        metrics.update(shaped)
        metrics["response/tokens"] = float(mask.sum())
        metrics["response/sequence_tokens"] = float(batch.attention_mask.sum())  # prompt + response
        metrics["response/length"] = float(mask.sum(1).mean())
        metrics["response/entropy"] = float(T.masked_mean(entropy, mask))
        if kl is not None:
            metrics["actor/kl"] = float(T.masked_mean(kl, mask, dim=-1).mean())
            metrics["actor/kl_coef"] = self.kl_ctl.value
            # The adaptive controller's input, of all ranks (the controllers stay equal), applied
            # after this round's update as LightRFT does, so the round trains with the coefficient it
            # sampled under. KL in the reward: the round's KL per response token (LightRFT's
            # length-weighted mean of the sequences'); KL as a loss: what the update measured (train_on).
            kl_sum, tokens, count = all_reduce_sum(torch.tensor(
                [float((kl * mask).sum()), float(mask.sum()), float(len(batch))], dtype=torch.float64)).tolist()
            self._round_kl = (kl_sum / max(tokens, 1.0) if v.kl_in_reward else None, int(count))
        if values is not None:
            metrics["critic/explained_variance"] = T.explained_variance(values, returns, mask)
        exp = Experience(batch, old_logp, adv, T.entropy_mask(entropy, mask, v.entropy_mask_ratio), ref_logp,
                         values, returns)
        return exp, metrics

    # --- consumer ------------------------------------------------------------------------
    def _policy_loss(self, exp: Experience, logp: torch.Tensor):
        v = self.cfg.vlm
        if v.policy_loss == "ppo":
            return T.ppo_policy_loss(logp, exp.old_logp, exp.advantages, exp.policy_mask, clip_low=v.clip_low,
                                     clip_high=v.clip_high, dual_clip=v.dual_clip, aggregation=v.aggregation)
        if v.policy_loss == "gspo":
            return T.gspo_loss(logp, exp.old_logp, exp.advantages, exp.policy_mask, clip_low=v.clip_low,
                               clip_high=v.clip_high)
        return T.cpg_loss(logp, exp.old_logp, exp.advantages, exp.policy_mask, clip=v.clip_high)

    def train_on(self, exp: Experience, step: int) -> dict:
        cfg, v = self.cfg, self.cfg.vlm
        self.policy.model.train()
        train_actor = step > v.freezing_actor_steps
        N = len(exp)
        # actor.ppo_mini_batch_size counts responses over all ranks
        mini = (cfg.actor.ppo_mini_batch_size // self.mesh.data_size) or N
        gen = torch.Generator().manual_seed(derive_seed(cfg.seed + step, "vlm_shuffle"))
        sums: dict[str, list[float]] = {}
        for _epoch in range(cfg.actor.ppo_epochs):
            order = torch.randperm(N, generator=gen) if cfg.actor.shuffle else torch.arange(N)
            for start in range(0, N, mini):
                rows = order[start:start + mini]
                actor_total = critic_total = 0.0
                for micro in self._micro(len(rows)):
                    sub = exp.select(rows[micro])
                    weight = len(micro) / len(rows)
                    if train_actor:
                        if v.entropy_coef > 0:
                            logp, entropy = self.policy.token_logprobs(sub.batch, temperature=v.temperature,
                                                                       with_entropy=True)
                        else:
                            logp = self.policy.token_logprobs(sub.batch, temperature=v.temperature)
                        loss, m = self._policy_loss(sub, logp)
                        if v.entropy_coef > 0:
                            # over every response token (not the entropy-masked subset), as verl does
                            bonus = T.aggregate(entropy, sub.batch.response_mask, v.aggregation)
                            loss = loss - v.entropy_coef * bonus
                            m["entropy_bonus"] = bonus.detach()
                        if sub.ref_logp is not None and not v.kl_in_reward:
                            kl = T.kl_estimate(logp, sub.ref_logp, sub.batch.response_mask, v.kl_estimator)
                            kl = T.masked_mean(kl, sub.batch.response_mask, dim=-1).mean()
                            loss = loss + self.kl_ctl.value * kl
                            sums.setdefault("actor/train_kl", []).append(kept_on_device(kl.detach()))
                        (loss * weight).backward()
                        actor_total = actor_total + kept_on_device(loss) * weight
                        for k, val in m.items():
                            sums.setdefault(f"actor/{k}", []).append(kept_on_device(val))
                        if v.ptx_coef > 0:
                            ptx = self._ptx_loss(len(sub), step, len(sums.get("actor/ptx_loss", ())))
                            (v.ptx_coef * ptx * weight).backward()
                            sums.setdefault("actor/ptx_loss", []).append(kept_on_device(ptx))
                    if self.critic is not None:
                        values = self.critic(sub.batch)
                        vloss, m = T.value_loss(values, sub.values, sub.returns, sub.batch.response_mask,
                                                clip=v.value_clip)
                        (vloss * weight).backward()
                        critic_total = critic_total + kept_on_device(vloss) * weight
                        for k, val in m.items():
                            sums.setdefault(f"critic/{k}", []).append(kept_on_device(val))
                # one read per optimizer step: the step waits for the gradients anyway
                actor_total, critic_total = float(actor_total), float(critic_total)
                if train_actor:
                    out = self.actor_learner.step(actor_total)
                    sums.setdefault("actor/pg_loss", []).append(actor_total)
                    sums.setdefault("actor/grad_norm", []).append(out.get("grad_norm", float("nan")))
                    if self.ema is not None:
                        T.ema_update(self.ema, self.trainable, v.ema_decay)
                if self.critic is not None:
                    self.critic_learner.step(critic_total)
                    sums.setdefault("critic/value_loss", []).append(critic_total)
        metrics = {k: float(sum(x)) / len(x) for k, x in sums.items()}
        if self._round_kl is not None:  # the adaptive KL controller, once per rollout round
            measured, count = self._round_kl
            if measured is None and "actor/train_kl" in metrics:  # the training-time KL, averaged over ranks
                measured = all_reduce_sum(torch.tensor([metrics["actor/train_kl"]], dtype=torch.float64)).item()
                measured /= self.mesh.data_size
            if measured is not None:  # None: a critic warm-up round trained no actor, measured no KL
                self.kl_ctl.update(measured, count)
            self._round_kl = None
        metrics["actor/lr"] = self.actor_learner.current_lr
        metrics["actor/trained"] = float(train_actor)
        return metrics

    def _ptx_loss(self, count: int, step: int, call: int) -> torch.Tensor:
        """Supervised loss on `count` rows of vlm.ptx_files, drawn with replacement from (seed,
        step, rank, call), so a resumed run draws the same rows: over every token of plain text
        (LightRFT's pretrain mode), or over the answer after image and question."""
        import torch.distributed as dist

        from pixelrl.vlm import qa_files

        if self._ptx_rows is None:  # checked on the driver before any worker started (vlm/config.py)
            self._ptx_rows = qa_files.open_ptx_files(tuple(self.cfg.vlm.ptx_files), self.cfg.data.prompt_key)
        rank = dist.get_rank() if dist.is_initialized() else 0
        gen = torch.Generator().manual_seed(derive_seed(self.cfg.seed * 1_000_003 + step, f"ptx/{rank}/{call}"))
        rows = [self._ptx_rows[i] for i in torch.randint(len(self._ptx_rows), (count,), generator=gen).tolist()]
        if "text" in rows[0]:
            return T.ptx_loss(*self.policy.text_logprobs([row["text"] for row in rows]))
        items = [qa_files.load_item(row) for row in rows]
        prompts = self.policy.prompts([it["image"] for it in items], [it["question"] for it in items])
        target = self.policy.with_responses(prompts, [str(it["answer"]) for it in items])
        return T.ptx_loss(self.policy.token_logprobs(target, temperature=1.0), target.response_mask)

    # --- state ---------------------------------------------------------------------------
    def _trainable_names(self) -> list[str]:
        return [n for n, p in self.policy.model.named_parameters() if p.requires_grad]

    def save(self, folder: str | Path, *, write: bool = True) -> None:
        """Trainable weights (and critic, EMA) as safetensors; optimizer, scheduler and KL
        controller states with torch.save (read back with weights_only=True). Every rank gathers
        (FSDP2 shards are all-gathered); only where `write` is true (rank 0) are files written."""
        from safetensors.torch import save_file

        names = self._trainable_names()
        tensors = {"actor": {n: full_tensor(p) for n, p in zip(names, self.trainable)}}
        state = {"actor_optimizer": optimizer_state(self.policy.model, self.actor_learner.optimizer),
                 "actor_scheduler": self.actor_learner.lr_scheduler.state_dict(),
                 "kl_ctl": self.kl_ctl.state_dict()}
        if self.reward_moments is not None:
            state["reward_moments"] = self.reward_moments.state_dict()
        if self.ema is not None:
            tensors["ema"] = {n: full_tensor(e) for n, e in zip(names, self.ema)}
        if self.critic is not None:
            tensors["critic"] = {k: full_tensor(t) for k, t in self.critic.named_parameters()}
            state["critic_optimizer"] = optimizer_state(self.critic, self.critic_learner.optimizer)
            state["critic_scheduler"] = self.critic_learner.lr_scheduler.state_dict()
        if not write:
            return
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for part, values in tensors.items():
            save_file({k: t.contiguous() for k, t in values.items()}, folder / f"{part}.safetensors")
        torch.save(state, folder / "optim.pt")

    def load(self, folder: str | Path) -> None:
        from safetensors.torch import load_file

        from pixelrl.engine.checkpoint import CheckpointError, read_checkpoint_file

        folder = Path(folder)
        names = self._trainable_names()
        weights = read_checkpoint_file(folder / "actor.safetensors", load_file)
        if sorted(weights) != sorted(names):
            raise CheckpointError(f"checkpoint `{folder}` holds other trainable weights than this model "
                                  f"({len(weights)} vs {len(names)} tensors): check model.lora_rank against the run "
                                  "that wrote it, or set trainer.resume_mode=disable")
        for n, p in zip(names, self.trainable):
            copy_full_into(p, weights[n])
        state = read_checkpoint_file(folder / "optim.pt", lambda p: torch.load(p, weights_only=True))
        set_optimizer_state(self.policy.model, self.actor_learner.optimizer, state["actor_optimizer"])
        self.actor_learner.lr_scheduler.load_state_dict(state["actor_scheduler"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        if self.reward_moments is not None:
            if "reward_moments" not in state:
                raise CheckpointError(f"checkpoint `{folder}` was written without vlm.reward_running_norm, so it "
                                      "holds no running reward moments: resume with the option as that run had it, "
                                      "or set trainer.resume_mode=disable")
            self.reward_moments.load_state_dict(state["reward_moments"])
        if self.ema is not None:
            ema = read_checkpoint_file(folder / "ema.safetensors", load_file)
            for n, e in zip(names, self.ema):
                copy_full_into(e, ema[n])
        if self.critic is not None:
            critic = read_checkpoint_file(folder / "critic.safetensors", load_file)
            params = dict(self.critic.named_parameters())
            for k, t in critic.items():
                copy_full_into(params[k], t)
            set_optimizer_state(self.critic, self.critic_learner.optimizer, state["critic_optimizer"])
            self.critic_learner.lr_scheduler.load_state_dict(state["critic_scheduler"])
