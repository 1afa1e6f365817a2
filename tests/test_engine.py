import pytest
import torch
from conftest import ScalarReads

from pixelrl.algos.losses import LossSpec
from pixelrl.core.errors import MissingBatchKeysError
from pixelrl.engine.learner import Learner
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


def test_max_consecutive_nonfinite_0_keeps_skipping_as_verl_omni(make_engine, tiny_sd3_path):
    engine, cfg = make_engine(tiny_sd3_path, actor__max_consecutive_nonfinite=0)
    batch = _batch(engine, cfg)
    batch["advantages"] = torch.full((len(batch),), float("nan"))
    for _ in range(4):
        assert engine.update(batch)["skipped_nonfinite"] == 1.0
    assert engine.policy_version == 0 and engine.learner.nonfinite_in_a_row == 4


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


def test_cosine_lr_schedule_by_hand():
    """lr 1.0, 2 warm-up steps, cosine over 6 optimizer steps down to 0.1: the lr the optimizer
    applies at each step, read back from the learner after each step."""
    from pixelrl.engine.learner import Learner

    weight = torch.nn.Parameter(torch.ones(1))
    learner = Learner(lambda: [weight], lr=1.0, warmup_steps=2, schedule="cosine", total_steps=6, min_lr_ratio=0.1)
    applied = []
    for _ in range(8):
        applied.append(learner.current_lr)
        weight.sum().backward()
        learner.step(1.0)
    # warm-up 1/2, 1; then 0.1 + 0.9 * (1 + cos(pi * k / 4)) / 2 for k = 0..4, then the floor
    expected = [0.5, 1.0, 1.0, 0.1 + 0.9 * 0.853553, 0.55, 0.1 + 0.9 * 0.146447, 0.1, 0.1]
    assert applied == pytest.approx(expected, abs=1e-6)
    constant = Learner(lambda: [weight], lr=1.0, warmup_steps=2)
    assert [constant.lr_factor(k) for k in range(4)] == [0.5, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="total_steps"):
        Learner(lambda: [weight], lr=1.0, schedule="cosine", total_steps=0)


@pytest.mark.parametrize("loss", ["flow_grpo", "flow_dppo"])
def test_window_steps_in_one_forward_give_the_same_update(make_engine, tiny_sd3_path, loss):
    """actor.window_steps_per_forward = 0 (all steps of a micro-batch side by side) against 1 (a
    forward per step): same reference scores, same metrics, same weights after two epochs of two
    mini-batches (off-policy ratios, KL, CFG), up to float reordering; far fewer forwards."""
    runs = []
    start = None
    for per_forward in (1, 0):
        engine, cfg = make_engine(tiny_sd3_path, actor__ppo_mini_batch_size=8, actor__ppo_micro_batch_size=4,
                                  actor__ppo_epochs=2, actor__window_steps_per_forward=per_forward,
                                  diffusion_loss__name=loss, diffusion_loss__kl_coef=0.04,
                                  rollout__guidance_scale=3.0)
        start = start or {n: p.detach().clone() for n, p in engine.model.transformer.named_parameters()
                          if p.requires_grad}
        batch = _batch(engine, cfg)
        reference = engine.score(batch, "reference")
        batch.update(reference)
        metrics = engine.update(batch)
        weights = {n: p.detach().clone() for n, p in engine.model.transformer.named_parameters() if p.requires_grad}
        runs.append((reference, metrics, weights))
    (ref_a, m_a, w_a), (ref_b, m_b, w_b) = runs
    assert ("dppo_masked_frac" in m_b) == (loss == "flow_dppo")
    torch.testing.assert_close(ref_b["ref_log_probs"], ref_a["ref_log_probs"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref_b["ref_means"], ref_a["ref_means"], rtol=1e-5, atol=1e-6)
    for key in ("pg_loss", "approx_kl", "clipfrac", "kl", "grad_norm", "rollout_logp_abs_diff", "dppo_masked_frac"):
        if key in m_a:
            assert m_b[key] == pytest.approx(m_a[key], rel=1e-4, abs=1e-7), key
    assert {"pg_loss", "kl", "grad_norm", "approx_kl"} <= m_a.keys()
    # Adam turns float-reordering noise in tiny gradient components into a visible share of a step
    update = max((w_a[n] - start[n]).abs().max().item() for n in w_a)
    apart = max((w_a[n] - p).abs().max().item() for n, p in w_b.items())
    print(f"largest weight change {update:.3g}, largest difference between the paths {apart:.3g}")
    assert update > 1e-3 and apart < 1e-3 * update
    steps = batch["sigmas"].shape[1]
    assert m_a["perf/denoiser_backwards"] == steps * m_b["perf/denoiser_backwards"]


def test_losses_with_batch_statistics_refuse_shared_forwards():
    from pixelrl.config import load_config
    from pixelrl.core.errors import ConfigError

    with pytest.raises(ConfigError, match="actor.window_steps_per_forward"):
        load_config("grpo_guard_tiny", ["actor.window_steps_per_forward=0", "model.path=builtin:shapes"])


def test_full_fine_tuning_of_a_bf16_model_steps_float32_master_weights(tiny_sd3_path):
    """lora_rank 0 on a bf16 model: the trained weights are float32 and an AdamW step of 1e-6
    moves them (on bf16 weights it would round away), the forwards compute in bf16 under autocast,
    and the frozen reference stays bf16."""
    from conftest import tiny_config

    from pixelrl.engine import PolicyEngine
    from pixelrl.models import load_model

    cfg = tiny_config(tiny_sd3_path, model__lora_rank=0, model__dtype="bfloat16", actor__lr=1e-6,
                      diffusion_loss__kl_coef=0.04)
    model = load_model("sd3", tiny_sd3_path, dtype="bfloat16", max_sequence_length=0)
    engine = PolicyEngine(model, cfg)
    trained = {n: p for n, p in model.transformer.named_parameters() if p.requires_grad}
    assert trained and all(p.dtype == torch.float32 for p in trained.values())
    assert all(p.dtype == torch.bfloat16 for p in engine._frozen_reference.parameters())
    x = torch.randn(2, *model.latent_shape(32, 32))
    text = model.encode_prompts(["a", "b"])
    seen = []
    hook = model.transformer.register_forward_hook(lambda m, a, out: seen.append(out[0].dtype))
    velocity = model.predict_velocity(x, torch.tensor(0.5), text)
    hook.remove()
    assert velocity.dtype == torch.float32 and seen == [torch.bfloat16]  # computed in bf16
    before = {n: p.detach().clone() for n, p in trained.items()}
    batch = _batch(engine, cfg)
    batch.update(engine.score(batch, "reference"))
    engine.update(batch)
    moved = sum(int((p != before[n]).sum()) for n, p in trained.items()) / sum(p.numel() for p in trained.values())
    assert moved > 0.5, moved


@pytest.mark.slow
def test_compiled_blocks_share_one_graph_per_block_structure(make_engine, tmp_path):
    """model.compile compiles blocks, not the forward: a denoiser of 6 blocks compiles as many
    graphs as one of 2 (a plain block and the last, context-only one), not one per block."""
    from torch._dynamo.utils import counters

    from pixelrl.models.sd3.tiny import build_tiny_sd3

    torch._dynamo.reset()  # graphs another test compiled for blocks of these widths would be reused
    compiled = []
    for layers in (6, 2):
        build_tiny_sd3(tmp_path / str(layers), num_layers=layers)
        engine, cfg = make_engine(tmp_path / str(layers), model__compile=True, rollout__guidance_scale=1.0)
        before = counters["stats"]["unique_graphs"]
        _batch(engine, cfg)
        _batch(engine, cfg, step=2)  # the FLOP counter's first forward of a shape runs eager
        compiled.append(counters["stats"]["unique_graphs"] - before)
    assert compiled[0] == 2 and compiled[1] == 0, compiled


@pytest.mark.parametrize("loss", ["flow_grpo", "dgpo"])
def test_the_update_reads_no_scalar_back_per_micro_batch(make_engine, tiny_sd3_path, loss):
    """The losses and metrics of an optimizer step's micro-batches stay on the device until the
    step: eight micro-batches read back exactly as many scalars as one."""
    reads = []
    for micro in (1, 8):
        extra = dict(algorithm__trainer_type="forward_process", rollout__noise_level=0.0,
                     algorithm__drop_zero_advantage=False) if loss == "dgpo" else {}
        engine, cfg = make_engine(tiny_sd3_path, actor__ppo_mini_batch_size=8, actor__ppo_micro_batch_size=micro,
                                  diffusion_loss__name=loss, **extra)
        batch = _batch(engine, cfg)
        with ScalarReads() as counter:
            metrics = engine.update(batch)
        assert metrics["policy_version"] == 2
        reads.append(counter.count)
    assert reads[0] == reads[1]


def test_the_weights_finite_check_reads_one_flag_whatever_the_number_of_weights():
    weights = [torch.nn.Parameter(torch.randn(3)) for _ in range(50)]
    learner = Learner(lambda: weights, lr=0.1)
    with ScalarReads() as counter:
        learner._check_weights_finite()
    assert counter.count == 1
    weights[37].data[1] = float("nan")
    with pytest.raises(FloatingPointError, match="not finite"):
        learner._check_weights_finite()
    # an infinite weight in a tensor of another dtype (bf16 weights beside float32 adapters)
    weights[37].data[1] = 0.0
    weights[12] = torch.nn.Parameter(torch.tensor([1.0, float("-inf")], dtype=torch.bfloat16))
    with pytest.raises(FloatingPointError, match="not finite"):
        Learner(lambda: weights, lr=0.1)._check_weights_finite()
    weights[12].data[1] = 3.0e38  # large but finite: no false alarm
    weights.append(torch.nn.Parameter(torch.empty(0)))  # an FSDP2 rank's empty shard of a small tensor
    Learner(lambda: weights, lr=0.1)._check_weights_finite()
