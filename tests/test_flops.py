"""perf/mfu: the FLOP meter by hand on a linear layer, and on every training step the denoiser's
forward and backward counts of the tiny config's schedule."""

import pytest
import torch

from conftest import read_metrics, train_cli
from pixelrl.engine.flops import FlopMeter, matmul_peak_flops, peak_memory_gb


def test_flop_meter_counts_forwards_by_hand_and_charges_graph_forwards_three_times():
    layer = torch.nn.Linear(8, 4, bias=False)
    meter = FlopMeter(layer)
    with torch.no_grad():
        layer(torch.randn(3, 8))              # 2 * 3 * 8 * 4 = 192
    layer(torch.randn(3, 8)).sum().backward()  # same shape, reused count, builds a graph: 3 * 192
    layer(torch.randn(5, 8))                   # a new shape is measured: 2 * 5 * 8 * 4 = 320, x3
    assert meter.per_shape and len(meter.per_shape) == 2
    metrics = meter.take(peak_flops=1e9)
    assert metrics["perf/tflop"] * 1e12 == pytest.approx(192 + 3 * 192 + 3 * 320)
    assert metrics["perf/denoiser_forwards"] == 3 and metrics["perf/denoiser_backwards"] == 2
    assert metrics["perf/mfu"] == pytest.approx(metrics["perf/achieved_tflops"] * 1e12 / 1e9)
    assert meter.take(peak_flops=1e9)["perf/tflop"] == 0  # reset


class Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)


def test_flop_meter_counts_attention_on_cpu_by_hand():
    attention = Attention()
    meter = FlopMeter(attention)
    q = torch.randn(2, 3, 5, 4)  # batch 2, 3 heads, 5 queries, head dim 4
    k, v = torch.randn(2, 3, 7, 4), torch.randn(2, 3, 7, 4)  # 7 keys
    with torch.no_grad():
        attention(q, k, v)
    # q k^T: 2 * 5 * 7 * 4 and (softmax) v: 2 * 5 * 7 * 4, per batch row and head
    assert meter.take(peak_flops=1e9)["perf/tflop"] * 1e12 == 2 * 3 * (2 * 5 * 7 * 4 + 2 * 5 * 7 * 4)


def test_a_variant_of_the_same_shape_is_measured_on_its_own():
    class Adapted(torch.nn.Module):  # an adapter that can be switched off, like LoRA for the reference
        def __init__(self):
            super().__init__()
            self.base, self.extra, self.on = torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(8, 4, bias=False), True

        def forward(self, x):
            return self.base(x) + self.extra(x) if self.on else self.base(x)

    module = Adapted()
    meter = FlopMeter(module, variant=lambda: module.on)
    x = torch.randn(3, 8)
    with torch.no_grad():
        module(x)            # on: 2 * (2 * 3 * 8 * 4) = 384
        module.on = False
        module(x)            # off, same shape: 192, not the 384 measured on
        module.on = True
        module(x)            # on again: the cached 384
    assert meter.take(peak_flops=1e9)["perf/tflop"] * 1e12 == 384 + 192 + 384


def test_reference_forwards_are_charged_without_the_adapter(tiny_pixel_path):
    """In the engine the policy is the variant: a reference forward (LoRA disabled) of the same
    input shape as a policy forward is measured on its own, and costs the base model only."""
    from pixelrl.engine import PolicyEngine
    from pixelrl.rewards import WeightedReward
    from pixelrl.testing import transition_step
    from conftest import tiny_config

    cfg = tiny_config(tiny_pixel_path, diffusion_loss__kl_coef=0.1, rollout__micro_batch_size=4,
                      actor__ppo_micro_batch_size=4, data__train_batch_size=1)
    engine = PolicyEngine.from_config(cfg)
    transition_step(engine, WeightedReward.from_functions(cfg.reward.functions), ["a red circle"], [{}], 1, cfg)
    flops = {variant: count for (variant, _shape), count in engine.flop_meter.per_shape.items()}
    assert set(flops) == {"current", "reference"} and len(engine.flop_meter.per_shape) == 2  # one shape
    assert flops["reference"] < flops["current"]


def test_matmul_peak_is_measured_once_and_positive():
    peak = matmul_peak_flops("cpu", torch.float32, size=256)
    assert peak > 1e8 and matmul_peak_flops("cpu", torch.float32, size=256) == peak


def test_peak_memory_follows_what_the_process_held():
    """A child process of this (large) test process: touching 0.5 GB raises its CPU figure by
    about that, from a start that is its own, not the parent's resident set."""
    import subprocess
    import sys

    script = ("import torch; from pixelrl.engine.flops import peak_memory_gb; before = peak_memory_gb('cpu'); "
              "x = torch.ones(125_000_000); print(before, peak_memory_gb('cpu'))")
    ballast = torch.ones(250_000_000)  # 1 GB resident in the parent, which getrusage would pass on
    before, after = map(float, subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                                              check=True).stdout.split())
    del ballast
    assert 0.05 < before < 2 and after - before == pytest.approx(0.5, abs=0.05)
    assert peak_memory_gb("cpu") >= peak_memory_gb(torch.device("cpu")) > 0


def test_every_step_reports_mfu_and_the_schedules_denoiser_calls(tmp_path, tiny_pixel_path):
    code, run = train_cli(tmp_path, tiny_pixel_path, "trainer.backend=local", "trainer.logger=[jsonl]",
                          "data.train_batch_size=2", "actor.ppo_mini_batch_size=4", "trainer.total_training_steps=2",
                          "trainer.save_freq=-1", "trainer.test_freq=-1")
    assert code == 0
    metrics = read_metrics(run)
    for m in metrics:
        # 2 prompts x 4 images, guidance 1 (no CFG batch), 6 steps in one rollout micro-batch:
        # 6 sampling forwards; steps 0..4 trained (the last, near-clean step stays ODE), 2 mini-batches
        # of 4 images: 2 x 5 forward+backward
        assert m["perf/denoiser_forwards"] == 6 + 10 and m["perf/denoiser_backwards"] == 10
        assert 0 < m["perf/mfu"] <= 1 and m["perf/tflop"] > 0
        assert m["perf/mfu"] == pytest.approx(m["perf/achieved_tflops"] / m["perf/peak_tflops"])
        assert "actor/perf/mfu" not in m
        assert 0 < m["perf/peak_memory_gb"] < 24
        # 8 images over one worker's step time
        assert m["training/images"] == 8 and m["perf/throughput"] == pytest.approx(8 / m["timing_s/step"])
    # the same shapes every step: the same FLOPs
    assert metrics[0]["perf/tflop"] == metrics[1]["perf/tflop"]
    # a configured peak replaces the measured one
    code, run = train_cli(tmp_path / "peak", tiny_pixel_path, "trainer.backend=local", "trainer.logger=[jsonl]",
                          "data.train_batch_size=2", "actor.ppo_mini_batch_size=4", "trainer.total_training_steps=1",
                          "trainer.save_freq=-1", "trainer.test_freq=-1", "trainer.peak_tflops=1000")
    assert code == 0 and read_metrics(run)[0]["perf/peak_tflops"] == 1000
