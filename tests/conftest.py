import contextlib
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
# PIXELRL_TEST_THREADS lets a developer keep a core free for a background job.
torch.set_num_threads(int(os.environ.get("PIXELRL_TEST_THREADS", max(1, min(2, os.cpu_count() or 1)))))

# the test session is an entry point as the CLI is: the built-in extensions' names (the shapes
# reward, the VLM trainer) are registered before a test looks one up in a lower layer's registry
from pixelrl.core.plugins import import_extensions  # noqa: E402

import_extensions()


@pytest.fixture(scope="session")
def tiny_sd3_path(tmp_path_factory):
    """A tiny random SD3 pipeline with a VAE (latent space), built offline once per session."""
    from pixelrl.models import build_tiny_sd3

    return build_tiny_sd3(tmp_path_factory.mktemp("tiny_sd3") / "pipe", resolution=32, with_vae=True, with_t5=False)


@pytest.fixture(scope="session")
def tiny_pixel_path(tmp_path_factory):
    """A tiny random SD3 pipeline working directly in RGB pixel space (no VAE)."""
    from pixelrl.models import build_tiny_sd3

    return build_tiny_sd3(tmp_path_factory.mktemp("tiny_pixel") / "pipe", resolution=32, with_vae=False,
                          with_t5=False)


@pytest.fixture(scope="session")
def tiny_flux_path(tmp_path_factory):
    """A tiny random FLUX.1-dev-style pipeline (guidance embedding, packed latents, CLIP + T5)."""
    from pixelrl.models.flux import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("tiny_flux") / "pipe", resolution=32)


@pytest.fixture(scope="session")
def tiny_kontext_path(tmp_path_factory):
    """A tiny random FLUX.1 Kontext pipeline (FLUX.1's components, an image condition)."""
    from pixelrl.models.flux_kontext import build_tiny_flux_kontext

    return build_tiny_flux_kontext(tmp_path_factory.mktemp("tiny_kontext") / "pipe", resolution=32)


@pytest.fixture(scope="session")
def tiny_qwen_edit_path(tmp_path_factory):
    """A tiny random Qwen-Image-Edit-2511 pipeline (a text encoder that sees the source, its
    processor, the source's latents beside the target's, zero_cond_t)."""
    from pixelrl.models.qwen_image_edit import build_tiny_qwen_image_edit

    return build_tiny_qwen_image_edit(tmp_path_factory.mktemp("tiny_qwen_edit") / "pipe", resolution=32)


@pytest.fixture(scope="session")
def tiny_qwen_image_path(tmp_path_factory):
    """A tiny random Qwen-Image pipeline (Qwen2.5-VL text states with masks, true CFG, packed latents)."""
    from pixelrl.models.qwen_image import build_tiny_qwen_image

    return build_tiny_qwen_image(tmp_path_factory.mktemp("tiny_qwen_image") / "pipe", resolution=32)


@pytest.fixture(scope="session")
def tiny_wan_path(tmp_path_factory):
    """A tiny random Wan 2.1 text-to-video pipeline (5-frame videos, 3 latent frames)."""
    from pixelrl.models.wan import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("tiny_wan") / "pipe")


@pytest.fixture(scope="session")
def tiny_wan22_path(tmp_path_factory):
    """A tiny random Wan 2.2 A14B-layout pipeline: two experts switching at 0.875 (A14B T2V's ratio),
    so a 4-step sample runs its first step on `transformer` and the other three on `transformer_2`."""
    from pixelrl.models.wan import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("tiny_wan22") / "pipe", boundary_ratio=0.875)


@pytest.fixture(scope="session")
def tiny_wan_ti2v_path(tmp_path_factory):
    """A tiny random Wan 2.2 TI2V-5B-layout pipeline: `expand_timesteps` and the residual Wan 2.2
    VAE (2 x 2 pixels folded into 12 channels, 4x spatial in all), 5-frame videos."""
    from pixelrl.models.wan import build_tiny_wan

    return build_tiny_wan(tmp_path_factory.mktemp("tiny_wan_ti2v") / "pipe", ti2v=True)


@contextlib.contextmanager
def gpu_node_memory():
    """This machine seen as a GPU node with 1 TB of memory and eight 80 GB GPUs: a paper recipe's
    step (DanceGRPO-Wan's holds 43 GB of videos and trajectories on the driver) passes the start-up
    size check, its eight workers find their GPUs, and its `auto` sizes are chosen for an 80 GB card."""
    from unittest import mock

    import psutil
    import torch

    from pixelrl.config import auto_size

    node = psutil.virtual_memory()._replace(total=1 << 40)
    with mock.patch.object(psutil, "virtual_memory", lambda: node), \
            mock.patch.object(torch.cuda, "device_count", lambda: 8), \
            mock.patch.object(auto_size, "worker_memory_gb", lambda cfg, field: (80.0, "a stand-in 80 GB GPU")):
        yield


def record_learning(before: float, after: float, margin: float | None) -> None:
    """Append a learning test's scores to PIXELRL_LEARNING_LOG, where `python
    tests/learning_spread.py` collects them across CPU kernels and thread counts."""
    log = os.environ.get("PIXELRL_LEARNING_LOG")
    if log:
        import json

        test = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
        with open(log, "a") as out:
            out.write(json.dumps({"test": test, "before": float(before), "after": float(after),
                                  "margin": margin}) + "\n")


def assert_learned(before: float, after: float, margin: float, *context) -> None:
    """A learning test's verdict: `after` beats `before` by more than `margin`, a margin set from
    the gain's measured spread over CPU kernels and thread counts (tests/README.md)."""
    record_learning(before, after, margin)
    assert after > before + margin, (before, after, *context)


class ScalarReads:
    """Counts pixelrl's tensor-to-Python reads (`float(t)`, `t.item()`, `if t:`) while active: on a
    GPU each one waits for every kernel queued before it. A read counts when the code that asked
    for it (the first caller outside torch) is pixelrl's, not a model library's."""

    def __init__(self):
        import traceback

        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        def asked_by_pixelrl() -> bool:
            for frame in reversed(traceback.extract_stack()):
                if f"{os.sep}torch{os.sep}" not in frame.filename and frame.filename != __file__:
                    return f"{os.sep}pixelrl{os.sep}" in frame.filename
            return False

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default) \
                        and asked_by_pixelrl():
                    counter.count += 1
                return func(*args, **(kwargs or {}))

        self.count, self._mode = 0, Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


_STAND_IN: list[str] = []


def stand_in_folder() -> str:
    """One empty folder for the whole session, removed when it ends (a folder per call left
    hundreds behind in /tmp)."""
    if not _STAND_IN:
        import atexit
        import shutil
        import tempfile

        _STAND_IN.append(tempfile.mkdtemp(prefix="pixelrl_stand_in_"))
        atexit.register(shutil.rmtree, _STAND_IN[0], True)
    return _STAND_IN[0]


def paper_config(name, *overrides):
    """A bundled config for a real checkpoint, validated with an empty folder standing in for the
    model folder this machine does not have (validation checks only that it exists), as on a GPU node."""
    from pixelrl.config import load_config
    from pixelrl.core.errors import ConfigError

    stand_in = f"model.path={stand_in_folder()}"
    with gpu_node_memory():
        try:
            return load_config(name, [stand_in, *overrides])
        except ConfigError as err:  # a reward model folder this machine lacks: a rule reward stands in
            if not ("reward.functions" in str(err) and "options.path" in str(err)):
                raise
            return load_config(name, [stand_in, "reward.functions=[{name: jpeg_compressibility, weight: 1.0}]",
                                      *overrides])


def random_sources(seed: int, count: int = 2) -> list[tuple[torch.Tensor]]:
    """One random 32 px uint8 source image per row, as edit data rows give them."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 256, (32, 32, 3), generator=generator, dtype=torch.uint8),) for _ in range(count)]


def check_edits_match_pipeline(engine, pipe, pipeline_latents, our_latents, sources, tmp_path):
    """pixelrl's edits equal the pipeline's and depend on the source, before and after a random
    LoRA (B made non-zero) that the checkpoint writes and the pipeline loads."""
    from pixelrl.engine.checkpoint import save_engine

    expected = pipeline_latents()
    assert torch.allclose(our_latents(sources), expected, atol=1e-5)
    assert (our_latents(list(reversed(sources))) - expected).abs().max() > 1e-3  # the source matters
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in engine.model.transformer.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    save_engine(engine, tmp_path / "actor")
    pipe.load_lora_weights(tmp_path / "actor" / "adapter")
    tuned = pipeline_latents()
    assert (tuned - expected).abs().max() > 1e-3
    assert torch.allclose(our_latents(sources), tuned, atol=1e-5)


def tiny_config(path, **overrides):
    """A small Flow-GRPO config on a tiny model; keyword overrides use `section__field`."""
    from pixelrl.config.sections import PixelRLConfig

    cfg = PixelRLConfig()
    cfg.model.path = str(path)
    cfg.model.max_sequence_length = 0
    cfg.model.lora_rank, cfg.model.lora_alpha = 8, 16
    cfg.rollout.resolution = 32
    cfg.rollout.n = 4
    cfg.rollout.num_steps = 6
    cfg.rollout.guidance_scale = 1.0
    cfg.actor.lr = 1e-2
    for key, value in overrides.items():
        section, name = key.split("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


@pytest.fixture
def make_engine():
    from pixelrl.engine import PolicyEngine
    from pixelrl.models import load_model

    def build(path, **overrides):
        cfg = tiny_config(path, **overrides)
        model = load_model(cfg.model.type, cfg.model.path, max_sequence_length=cfg.model.max_sequence_length)
        return PolicyEngine(model, cfg), cfg

    return build


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the tests that need it (started lazily, stopped at the end)."""
    import ray

    from pixelrl.workers.local_ray import start_local_ray

    start_local_ray(max(2, os.cpu_count() or 1))  # as `pixelrl train` starts one: loopback only
    yield
    ray.shutdown()


def train_cli(tmp_path, model_path, *overrides, config="flow_grpo_tiny"):
    """Run `pixelrl train` in-process; returns (exit code, run folder)."""
    from pixelrl.cli import main

    args = ["train", "--config-name", config, f"model.path={model_path}", f"trainer.default_local_dir={tmp_path}",
            "trainer.num_cpus_per_worker=1", *overrides]
    code = main(args)
    return code, tmp_path / "pixelrl" / "flow_grpo_tiny"


def read_metrics(run_dir):
    import json

    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="session")
def tiny_vlm_path(tmp_path_factory):
    """A tiny random Qwen2-VL with the shapes-QA vocabulary (built offline)."""
    from pixelrl.shapes import qa as shapes_qa
    from pixelrl.models.qwen_vl.tiny import build_tiny_qwen_vl

    return build_tiny_qwen_vl(tmp_path_factory.mktemp("vlm") / "tiny", words=shapes_qa.vocabulary(), seed=0)


@pytest.fixture(scope="session")
def tiny_vlm25_path(tmp_path_factory):
    """A tiny random Qwen2.5-VL (windowed vision attention, SwiGLU) with the shapes-QA vocabulary:
    two vision blocks, the first windowed, so the window reordering is exercised."""
    from pixelrl.shapes import qa as shapes_qa
    from pixelrl.models.qwen_vl.tiny import build_tiny_qwen_vl

    return build_tiny_qwen_vl(tmp_path_factory.mktemp("vlm25") / "tiny", words=shapes_qa.vocabulary(), seed=0,
                              version="2.5", vision_depth=2)


@pytest.fixture(params=["qwen2_vl", "qwen2_5_vl"])
def any_tiny_vlm_path(request):
    """Each tiny vision-language family the adapter supports, in turn."""
    return request.getfixturevalue("tiny_vlm_path" if request.param == "qwen2_vl" else "tiny_vlm25_path")


@pytest.fixture(scope="session")
def ptx_file(tmp_path_factory):
    """A supervised set for vlm.ptx_coef: 16 shapes-QA validation items as (image, question, answer) rows."""
    from pixelrl.shapes import qa as shapes_qa
    from pixelrl.vlm import qa_files

    return qa_files.write_qa_file(shapes_qa.items("val", 0, 16), tmp_path_factory.mktemp("ptx") / "ptx.jsonl")


def vlm_config(path, tmp_path, *overrides):
    """The shapes-QA GRPO config shrunk for tests (4 questions x 4 answers, 12 held-out items, in-process)."""
    from pixelrl.config import load_config

    return load_config("vlm_grpo_shapes_qa", [
        f"model.path={path}", f"trainer.default_local_dir={tmp_path}", "data.train_batch_size=4", "rollout.n=4",
        "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size=4", "vlm.val_items=12",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.logger=[jsonl]",
        "trainer.backend=local", "trainer.n_workers=1", *overrides])


def ray_actor_pids(class_name: str) -> set[int]:
    """Process ids of this machine's live Ray actors of class `class_name` (titled `ray::<class>`)."""
    import psutil

    return {p.pid for p in psutil.process_iter(["cmdline"])
            if (p.info["cmdline"] or [""])[0].startswith(f"ray::{class_name}")}


def vlm_run_killed_after_checkpoint(cfg, monkeypatch, step: int) -> None:
    """Run the vision-language trainer on `cfg` and kill it (from the driver, so Ray workers die
    too) right after it has written its step-`step` checkpoint: an interruption mid-run that,
    unlike a shorter run, keeps the run's lr schedule."""
    import pixelrl.vlm.trainer as vlm_ppo

    save = vlm_ppo.save_checkpoint

    def save_then_die(root, at, *args, **kwargs):
        folder = save(root, at, *args, **kwargs)
        if at == step:
            raise RuntimeError(f"killed after the step-{step} checkpoint")
        return folder

    with monkeypatch.context() as patch:
        patch.setattr(vlm_ppo, "save_checkpoint", save_then_die)
        with pytest.raises(RuntimeError, match="killed after"):
            vlm_ppo.VLMPPOTrainer(cfg).fit()


def experience_with_reward_inputs(cfg, count: int = 4):
    """One VLM experience step on `count` train questions, with what the reward was called on:
    (engine, experience, metrics, {"texts", "questions", "meta"})."""
    from pixelrl.vlm.engine import VLMEngine
    from pixelrl.vlm.qa_tasks import task_items

    engine = VLMEngine(cfg)
    captured = {}
    inner = engine.reward

    def spy(texts, questions, meta):
        captured.update(texts=texts, questions=questions, meta=meta)
        return inner(texts, questions, meta)

    engine.reward = spy
    exp, metrics = engine.make_experience(task_items(cfg, "train", 0, count), 1)
    return engine, exp, metrics, captured


def with_extra_object(spec: dict, shape: str, colour: str, count: int = 1) -> dict:
    """A shapes scene spec with `count` more objects that the prompt did not ask for."""
    return {**spec, "objects": [*spec["objects"], {"shape": shape, "colour": colour, "count": count}]}


def damaged_png(path):
    """A PNG whose chunks and CRCs are whole but whose compressed pixel data is not: PIL's
    `verify()` passes it, decoding fails."""
    import struct
    import zlib

    from PIL import Image

    Image.fromarray(torch.randint(0, 256, (32, 32, 3), generator=torch.Generator().manual_seed(0),
                                  dtype=torch.uint8).numpy()).save(path)
    data = bytearray(path.read_bytes())
    start = data.index(b"IDAT")
    length = struct.unpack(">I", data[start - 4:start])[0]
    for i in range(start + 4 + length // 3, start + 4 + length // 3 + 24):
        data[i] ^= 0x5A
    crc = zlib.crc32(bytes(data[start:start + 4 + length])) & 0xFFFFFFFF
    data[start + 4 + length:start + 8 + length] = struct.pack(">I", crc)
    path.write_bytes(bytes(data))
    with Image.open(path) as opened:
        opened.verify()  # the damage this test is about is the kind verify() cannot see
    return path.name


def stand_in_safetensors(path):
    """A whole, readable safetensors file (one small tensor) where a test needs a weights file to
    be there but not to fit a model."""
    from safetensors.torch import save_file

    save_file({"stand_in.weight": torch.zeros(2, 2)}, str(path))
