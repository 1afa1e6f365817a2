import pytest
import torch

from pixelrl.algos.losses import LossSpec
from pixelrl.core.errors import MissingBatchKeysError
from pixelrl.trainers.step import compute_advantages, expand_prompts

PROMPTS = ["a red circle", "two blue squares", "a cat", "a house"]


def _batch(engine, cfg, step=1):
    samples = expand_prompts(PROMPTS, [{}] * 4, cfg.rollout.n, seed=step)
    batch = engine.rollout(samples["prompts"], samples["seeds"])
    batch["uids"] = samples["uids"]
    torch.manual_seed(step)
    batch["rewards"] = torch.randn(len(batch))
    batch["advantages"] = compute_advantages(batch["rewards"], batch["uids"], cfg.algorithm)
    return batch


def _record_ratios(engine):
    """Wrap the engine's loss so every call's per-sample ratio is recorded, in order."""
    seen = []
    inner = engine.loss

    def recording(step, cfg):
        seen.append(torch.exp(step["log_prob"] - step["old_log_prob"]).detach())
        return inner.fn(step, cfg)

    engine.loss = LossSpec(inner.name, recording, inner.batch_keys, inner.step_keys)
    return seen


def test_first_minibatch_ratio_is_exactly_one_when_on_policy(make_engine, tiny_sd3_path):
    engine, cfg = make_engine(tiny_sd3_path, actor__ppo_mini_batch_size=8, actor__ppo_micro_batch_size=4)
    batch = _batch(engine, cfg)
    seen = _record_ratios(engine)
    metrics = engine.update(batch)
    steps = batch["sigmas"].shape[1]
    first = torch.cat(seen[: 2 * steps])  # 2 micro-batches x window steps of the first mini-batch
    assert torch.equal(first, torch.ones_like(first))
    later = torch.cat(seen[2 * steps:])  # the weights moved after the first optimizer step
    assert not torch.equal(later, torch.ones_like(later))
    assert metrics["policy_version"] == 2 and metrics["rollout_logp_abs_diff"] < 1e-3


def test_single_minibatch_update_reports_ratio_one(make_engine, tiny_sd3_path):
    engine, cfg = make_engine(tiny_sd3_path)
    metrics = engine.update(_batch(engine, cfg))
    assert metrics["ratio_mean"] == 1.0 and metrics["ratio_std"] == 0.0 and metrics["clipfrac"] == 0.0
    assert metrics["grad_norm"] > 0 and metrics["lr"] == cfg.actor.lr


def test_update_changes_only_the_adapter(make_engine, tiny_sd3_path):
    engine, cfg = make_engine(tiny_sd3_path)
    before = {n: p.detach().clone() for n, p in engine.model.transformer.named_parameters()}
    engine.update(_batch(engine, cfg))
    changed = {n for n, p in engine.model.transformer.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all("lora_" in n for n in changed)


def test_reference_policy_is_the_base_model(make_engine, tiny_sd3_path):
    engine, cfg = make_engine(tiny_sd3_path, diffusion_loss__kl_coef=0.04)
    batch = _batch(engine, cfg)
    ref_before = engine.score(batch, "reference")
    for _ in range(2):
        batch.update(engine.score(batch, "reference"))
        metrics = engine.update(batch)
    ref_after = engine.score(batch, "reference")
    current = engine.score(batch, "current")
    assert torch.equal(ref_before["ref_means"], ref_after["ref_means"])
    assert not torch.allclose(current["old_means"], ref_after["ref_means"])
    assert metrics["kl"] > 0


def test_full_finetuning_with_kl_keeps_a_frozen_reference(make_engine, tiny_sd3_path):
    engine, cfg = make_engine(tiny_sd3_path, model__lora_rank=0, diffusion_loss__kl_coef=0.04, actor__lr=1e-4)
    batch = _batch(engine, cfg)
    batch.update(engine.score(batch, "reference"))
    engine.update(batch)
    ref = engine.score(batch, "reference")["ref_means"]
    assert torch.equal(ref, batch["ref_means"])  # the reference did not move with the policy
    assert not torch.equal(engine.score(batch, "current")["old_means"], ref)


def test_missing_batch_keys_are_listed(make_engine, tiny_sd3_path):
    engine, cfg = make_engine(tiny_sd3_path, diffusion_loss__kl_coef=0.1)
    batch = _batch(engine, cfg)
    with pytest.raises(MissingBatchKeysError, match=r"KL term.*\['ref_means'\].*available keys"):
        engine.update(batch)
    del batch.tensors["advantages"]
    with pytest.raises(MissingBatchKeysError, match=r"flow_grpo.*\['advantages'\]"):
        engine.update(batch)


def test_nonfinite_updates_are_skipped_then_stop_the_run(make_engine, tiny_sd3_path):
    engine, cfg = make_engine(tiny_sd3_path, actor__max_consecutive_nonfinite=2)
    batch = _batch(engine, cfg)
    batch["advantages"] = torch.full((len(batch),), float("nan"))
    before = {n: p.detach().clone() for n, p in engine.model.transformer.named_parameters() if p.requires_grad}
    metrics = engine.update(batch)
    assert metrics["skipped_nonfinite"] == 1.0 and engine.policy_version == 0
    assert all(torch.equal(p, before[n]) for n, p in engine.model.transformer.named_parameters() if p.requires_grad)
    with pytest.raises(FloatingPointError, match="2 consecutive updates"):
        engine.update(batch)


def test_batch_rejects_a_field_of_the_wrong_length():
    from pixelrl.core.batch import Batch

    batch = Batch(values={"prompts": ["a", "b"]})
    with pytest.raises(ValueError, match="field `rewards` has 3 entries, the batch has 2"):
        batch["rewards"] = torch.zeros(3)
    batch["rewards"] = torch.zeros(2)
    batch["rewards"] = torch.ones(2)  # replacing a field with one of the same length is fine
    assert len(batch.shard(2)) == 2 and batch.repeat_interleave(2)["prompts"] == ["a", "a", "b", "b"]


def test_weights_that_turn_non_finite_stop_the_run_at_that_step():
    from pixelrl.engine.learner import Learner

    weight = torch.nn.Parameter(torch.ones(3))
    learner = Learner(lambda: [weight], lr=float("inf"))
    (weight * torch.tensor([1.0, -1.0, 2.0])).sum().backward()  # a finite loss and gradient ...
    with pytest.raises(FloatingPointError, match="actor.lr=inf"):  # ... and infinite weights after the step
        learner.step(1.0)
    other = torch.nn.Parameter(torch.ones(3))
    healthy = Learner(lambda: [other], lr=0.1)
    other.sum().backward()
    assert healthy.step(1.0)["stepped"] == 1.0 and torch.isfinite(other).all()
