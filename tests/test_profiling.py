"""`trainer.profile_step`'s summary: device work sorted into categories and credited to the worker
phase that started it (checked on a CPU profile, where the work is aten operators)."""

import gzip
import json

import torch

from pixelrl.engine.memory import naming_the_phase
from pixelrl.engine.profiling import OTHER, StepProfiler, category


def test_kernel_names_fall_into_their_categories():
    assert category("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n") == "matmul"
    assert category("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT") == "matmul"
    assert category("aten::addmm") == "matmul"
    assert category("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>") == "attention"
    assert category("cudnn_generated_fort_native_sdpa_sm90") == "attention"
    assert category("ncclDevKernel_AllGather_RING_LL") == "communication"
    assert category("Memcpy DtoH (Device -> Pinned)") == "copies"
    assert category("void at::native::vectorized_elementwise_kernel<4, at::native::GeluCUDAKernelImpl>") == OTHER


def test_work_is_credited_to_the_phase_that_started_it(tmp_path):
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    profiler = StepProfiler("cpu")
    profiler.start()
    with naming_the_phase("sampling"):
        for _ in range(20):
            torch.mm(a, b)
    with naming_the_phase("update"):
        for _ in range(20):
            torch.nn.functional.gelu(a * 2.0)
    summary = profiler.stop(tmp_path, step=7, rank=1)

    assert summary["categories"]["matmul"] > 0 and summary["categories"][OTHER] > 0
    assert summary["phases"]["sampling"]["busy_s"] >= summary["categories"]["matmul"] * 0.99
    assert summary["phases"]["update"]["busy_s"] >= summary["categories"][OTHER] * 0.99
    assert summary["busy_s"] <= summary["wall_s"]
    names = {name for name, _, _ in summary["top"]}
    assert {"aten::mm", "aten::gelu"} <= names
    text = (tmp_path / "step_7_rank_1.txt").read_text()
    assert text.startswith("step 7 on cpu") and "sampling" in text and "update" in text
    trace = json.loads(gzip.open(tmp_path / "step_7_rank_1.json.gz").read())
    assert any(e.get("name") == "pixelrl/update" for e in trace["traceEvents"])
