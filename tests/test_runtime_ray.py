"""The Ray runtime: 2-worker DDP and FSDP2 runs through `pixelrl train`, checkpoints, errors."""

import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import ray_actor_pids, read_metrics, train_cli


TWO_WORKERS = ("trainer.n_workers=2", "trainer.logger=[jsonl]", "trainer.save_freq=1", "trainer.total_training_steps=2")


@pytest.fixture(scope="module")
def two_worker_run(ray_cluster, tmp_path_factory, tiny_pixel_path):
    """One uninterrupted 2-worker DDP run of 2 steps with a checkpoint per step, made once for the
    tests that read it (a test that writes into it works on a copy)."""
    root = tmp_path_factory.mktemp("two_worker_run")
    code, run = train_cli(root, tiny_pixel_path, *TWO_WORKERS, "trainer.strategy=ddp")
    assert code == 0
    return root


# FSDP2 resume is also covered by the VLM trainer's and the crash sweep's FSDP2 runs
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp2", marks=pytest.mark.slow)])
def test_two_worker_run_writes_metrics_and_a_checkpoint_that_reloads(ray_cluster, tmp_path, tiny_pixel_path, strategy,
                                                                     request):
    import shutil

    if strategy == "ddp":  # the shared run, copied: this test resumes it
        shutil.copytree(request.getfixturevalue("two_worker_run") / "pixelrl", tmp_path / "pixelrl")
        run = tmp_path / "pixelrl" / "flow_grpo_tiny"
    else:
        code, run = train_cli(tmp_path, tiny_pixel_path, *TWO_WORKERS, f"trainer.strategy={strategy}")
        assert code == 0
    metrics = read_metrics(run)
    assert [m["step"] for m in metrics] == [1, 2]
    for key in ("critic/rewards/mean", "critic/rewards/zero_std_ratio", "critic/rewards/group_size",
                "critic/advantages/mean", "actor/pg_loss", "actor/grad_norm", "actor/lr", "actor/clipfrac",
                "actor/approx_kl", "timing_s/gen", "timing_per_image_ms/update_actor", "perf/throughput"):
        assert key in metrics[0], key
    assert metrics[0]["critic/rewards/group_size"] == 4.0
    # throughput is per worker (per device): the step's images over both workers' wall time, halved
    images = metrics[0]["training/images"]
    assert images == 4 * 4  # train_batch_size 4 x rollout.n 4
    assert metrics[0]["perf/throughput"] == pytest.approx(images / metrics[0]["timing_s/step"] / 2)
    assert 0 < metrics[0]["perf/peak_memory_gb"] < 24
    ckpt = run / "checkpoints" / "global_step_2" / "actor"
    assert (ckpt / "adapter" / "pytorch_lora_weights.safetensors").is_file()
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text() == "2"
    weights = load_file(str(ckpt / "trainable.safetensors"))
    # reload: resume (auto) and run one more step from the checkpoint
    code, _ = train_cli(tmp_path, tiny_pixel_path, "trainer.n_workers=2", f"trainer.strategy={strategy}",
                        "trainer.total_training_steps=3", "trainer.logger=[jsonl]")
    assert code == 0
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3]
    later = load_file(str(run / "checkpoints" / "global_step_3" / "actor" / "trainable.safetensors"))
    assert set(later) == set(weights) and any(not torch.equal(later[k], weights[k]) for k in weights)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_hold_identical_weights_equal_to_a_one_worker_run(ray_cluster, tiny_pixel_path, strategy):
    """Data parallelism must be invisible: after two updates both ranks hold the same weights and
    the same EMA of them, and both equal (to float reordering) what one worker computes on the
    same global batch."""
    import numpy as np

    from pixelrl.core.config_io import to_yaml
    from pixelrl.config import load_config
    from pixelrl.workers.group import LocalWorkerGroup, RayWorkerGroup, RewardGroup
    from pixelrl.testing import transition_step

    cfg = load_config("flow_grpo_tiny", [f"model.path={tiny_pixel_path}", "trainer.n_workers=2",
                                         f"trainer.strategy={strategy}", "actor.lr=1e-3",
                                         "algorithm.drop_zero_advantage=false", "actor.ema_decay=0.5"])
    rewards = RewardGroup([dict(f) for f in cfg.reward.functions], backend="local")
    prompts = ["a red circle", "two blue squares", "a cat on a house", "a green tree"]

    def train(group):
        try:
            for step in (1, 2):
                _, metrics = transition_step(group, rewards, prompts, [{}] * 4, step, cfg, uids=list("abcd"),
                                                  num_workers=group.size)
            return group.trainable_states(), metrics
        finally:
            group.shutdown()

    group = RayWorkerGroup(to_yaml(cfg), 2, 1)
    units = group.call("fsdp_units", gather="all")
    # FSDP2 shards every SD3 joint block (the family's `_no_split_modules`) and the root; DDP nothing
    expected = ["SD3Transformer2DModel"] + ["JointTransformerBlock"] * 2 if strategy == "fsdp2" else []
    assert units == [expected, expected]
    (rank0, rank1), two_metrics = train(group)
    (single,), one_metrics = train(LocalWorkerGroup(to_yaml(cfg)))
    assert rank0.keys() == rank1.keys() == single.keys()
    assert sum(k.startswith("ema/") for k in single) == len(single) // 2
    assert all(np.array_equal(rank0[k], rank1[k]) for k in rank0)
    assert two_metrics["critic/rewards/mean"] == pytest.approx(one_metrics["critic/rewards/mean"], abs=1e-6)
    moved = max(float(np.abs(single[k]).max()) for k in single if "lora_B" in k)
    assert moved > 1e-4  # the updates did move the adapter ...
    worst = max(float(np.abs(rank0[k] - single[k]).max()) for k in single)
    assert worst < 1e-3 * moved  # ... and two workers moved it the same way as one (tolerance 0.1%)


def test_a_failing_worker_is_reported_by_rank_and_releases_its_resources(ray_cluster, tmp_path, capsys):
    import ray

    from pixelrl.cli import main

    broken = tmp_path / "broken_model"
    (broken / "transformer").mkdir(parents=True)
    code = main(["train", "--config-name", "flow_grpo_tiny", f"model.path={broken}",
                 f"trainer.default_local_dir={tmp_path}", "trainer.num_cpus_per_worker=1", "trainer.n_workers=2"])
    assert code == 2  # a clear error, not a traceback
    err = capsys.readouterr().err
    assert "actor worker rank" in err and "lacks the component folder" in err
    deadline = time.time() + 30  # resources come back asynchronously
    while ray.available_resources().get("CPU", 0) < 2 and time.time() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0) >= 2  # the placement group was released


@pytest.mark.slow  # one-process direct-preference resume stays in the default run (test_direct_preference.py)
def test_direct_preference_resume_is_exact_with_two_workers(ray_cluster, tmp_path, tiny_pixel_path):
    """DiffusionNFT on 2 DDP workers: 4 steps == 2 + 2 bitwise, the old adapter included."""
    common = ("trainer.n_workers=2", "trainer.logger=[jsonl]", "trainer.experiment_name=flow_grpo_tiny",
              "trainer.save_freq=2", "data.train_batch_size=2")
    code, straight = train_cli(tmp_path / "straight", tiny_pixel_path, *common, "trainer.total_training_steps=4",
                               config="nft_tiny")
    assert code == 0
    code, split = train_cli(tmp_path / "split", tiny_pixel_path, *common, "trainer.total_training_steps=2",
                            config="nft_tiny")
    assert code == 0
    code, _ = train_cli(tmp_path / "split", tiny_pixel_path, *common, "trainer.total_training_steps=4",
                        config="nft_tiny")
    assert code == 0
    assert [m["critic/rewards/mean"] for m in read_metrics(split)] == \
           [m["critic/rewards/mean"] for m in read_metrics(straight)]
    for name in ("trainable.safetensors", "old_adapter.safetensors"):
        a = load_file(str(straight / "checkpoints" / "global_step_4" / "actor" / name))
        b = load_file(str(split / "checkpoints" / "global_step_4" / "actor" / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


@pytest.mark.parametrize("family, units", [
    ("flux", ["FluxTransformer2DModel", "FluxTransformerBlock", "FluxSingleTransformerBlock",
              "FluxSingleTransformerBlock"]),
    # ~27 s each: FLUX in the default run, the others with `pytest -m slow`
    pytest.param("qwen_image", ["QwenImageTransformer2DModel", "QwenImageTransformerBlock",
                                "QwenImageTransformerBlock"], marks=pytest.mark.slow),
    pytest.param("wan", ["WanTransformer3DModel", "WanTransformerBlock", "WanTransformerBlock"],
                 marks=pytest.mark.slow),
])
def test_fsdp2_on_two_ray_workers_shards_each_familys_blocks_and_ranks_agree(ray_cluster, request, family, units):
    """A family's FSDP units are its own (`_no_split_modules`): FLUX's double- and single-stream
    blocks, Qwen-Image's and Wan's blocks are all-gather units on both ranks, and after an update
    the ranks hold the same weights. FLUX runs in bf16, as on GPUs: its units then hold bf16 base
    weights beside float32 LoRA weights, which FSDP2 must all-gather together."""
    import numpy as np

    from pixelrl.core.config_io import to_yaml
    from pixelrl.config import load_config
    from pixelrl.testing import transition_step
    from pixelrl.workers.group import RayWorkerGroup, RewardGroup

    path = request.getfixturevalue(f"tiny_{family}_path")
    cfg = load_config(f"flow_grpo_{family}_tiny", [f"model.path={path}", "trainer.n_workers=2",
                                              "trainer.strategy=fsdp2", "algorithm.drop_zero_advantage=false",
                                              f"model.dtype={'bfloat16' if family == 'flux' else 'float32'}"])
    rewards = RewardGroup([dict(f) for f in cfg.reward.functions], backend="local")
    group = RayWorkerGroup(to_yaml(cfg), 2, 1)
    try:
        assert group.call("fsdp_units", gather="all") == [units, units]
        start = group.trainable_states()[0]
        transition_step(group, rewards, ["a red circle", "a cat", "a tree", "a car"], [{}] * 4, 1, cfg,
                             uids=list("abcd"), num_workers=2)
        rank0, rank1 = group.trainable_states()
    finally:
        group.shutdown()
    assert all(np.array_equal(rank0[k], rank1[k]) for k in rank0)
    assert any(not np.array_equal(rank0[k], start[k]) for k in rank0)  # the update moved the adapter


def test_a_worker_killed_by_a_signal_is_reported_with_what_its_log_says(ray_cluster, tiny_pixel_path):
    """A native crash in a worker (a SIGSEGV sent to it) is more than Ray's "connection error":
    the error names the rank, the worker's log file and the signal report the log holds."""
    import os
    import re
    import signal

    from pixelrl.core.config_io import to_yaml
    from pixelrl.config import load_config
    from pixelrl.workers.group import RayWorkerGroup, WorkerDiedError

    group = RayWorkerGroup(to_yaml(load_config("flow_grpo_tiny", [f"model.path={tiny_pixel_path}"])), 1, 1)
    try:
        with pytest.raises(WorkerDiedError) as died:
            group.call("__ray_call__", None, lambda worker: os.kill(os.getpid(), signal.SIGSEGV), gather="all")
    finally:
        group.shutdown()
    assert died.value.process_died  # what makes `trainer.max_restarts` start the workers again
    message = str(died.value)
    assert re.search(r"actor worker rank 0 \(pid \d+\) failed", message), message
    log = re.search(r"Its log (\S+/worker-\S+\.err) says: (.*)", message)
    assert log is not None, message
    assert "SIGSEGV received" in log.group(2) and "Segmentation fault" in log.group(2)
    assert os.path.isfile(log.group(1))


@pytest.mark.slow  # ~8 s; the default run reports a killed and a failing worker (above)
def test_a_crashed_rank_is_reported_before_a_peer_that_raised(ray_cluster, tiny_pixel_path):
    """A rank that dies breaks its peers' collectives, and their exceptions ("connection closed")
    can reach the driver first. Here rank 0 raises at once and rank 1 dies of a signal a second
    later: the report names rank 1 and its crash, the likelier cause."""
    import os
    import signal

    from pixelrl.core.config_io import to_yaml
    from pixelrl.config import load_config
    from pixelrl.workers.group import RayWorkerGroup, WorkerDiedError

    def collective_broke(worker):
        raise RuntimeError("[gloo] connection closed by peer")

    def crash(worker):
        import time

        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGSEGV)

    cfg = load_config("flow_grpo_tiny", [f"model.path={tiny_pixel_path}", "trainer.n_workers=2"])
    group = RayWorkerGroup(to_yaml(cfg), 2, 1)
    try:
        with pytest.raises(WorkerDiedError) as died:
            group._wait(group._launch("__ray_call__", [(collective_broke,), (crash,)]))
    finally:
        group.shutdown()
    message = str(died.value)
    assert message.startswith("actor worker rank 1 (pid ") and "SIGSEGV received" in message, message


# ~35 s; the default run has the restart loop on a scripted trainer (test_interruption.py), a killed
# worker reported as a process death (above) and exact resume on two workers (test_direct_preference_resume_...)
@pytest.mark.slow
def test_pixelrl_train_restarts_a_dead_worker_and_ends_as_an_uninterrupted_run(ray_cluster, tmp_path, tiny_pixel_path,
                                                                               monkeypatch, two_worker_run):
    """`pixelrl train ... trainer.max_restarts=1` (Flow-GRPO, 2 workers): a worker killed by SIGSEGV
    right after the step-1 checkpoint is started again from it; the run's metrics (each step once)
    and its step-2 weights equal those of a run that was never interrupted."""
    import os
    import signal

    import pixelrl.trainers.controller as policy_gradient

    straight = two_worker_run / "pixelrl" / "flow_grpo_tiny"  # the same run, never interrupted
    already_running = ray_actor_pids("PolicyWorker")
    save, crashed = policy_gradient.save_checkpoint, []

    def save_then_crash_a_worker(root, step, *args, **kwargs):
        save(root, step, *args, **kwargs)
        if step == 1 and not crashed:
            crashed.append(max(ray_actor_pids("PolicyWorker") - already_running))
            os.kill(crashed[0], signal.SIGSEGV)

    monkeypatch.setattr(policy_gradient, "save_checkpoint", save_then_crash_a_worker)
    code, restarted = train_cli(tmp_path / "restarted", tiny_pixel_path, *TWO_WORKERS, "trainer.strategy=ddp",
                                "trainer.max_restarts=1")
    assert code == 0 and crashed
    rows = read_metrics(restarted)
    assert [m["critic/rewards/mean"] for m in rows] == [m["critic/rewards/mean"] for m in read_metrics(straight)]
    a = load_file(str(straight / "checkpoints" / "global_step_2" / "actor" / "trainable.safetensors"))
    b = load_file(str(restarted / "checkpoints" / "global_step_2" / "actor" / "trainable.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_ray_cluster_pixelrl_starts_listens_on_loopback_only(ray_cluster):
    """The fixture starts Ray as `pixelrl train` does (start_local_ray): every Ray server of this
    machine's cluster (GCS, raylet, object manager, workers, agents) accepts loopback only."""
    import os

    import psutil
    import ray

    @ray.remote(num_cpus=0)
    class Probe:
        def pid(self):
            return os.getpid()

    probe = Probe.remote()
    worker_pid = ray.get(probe.pid.remote())
    processes = [psutil.Process(), *psutil.Process().children(recursive=True)]
    assert worker_pid in {p.pid for p in processes}
    listening = [(p.name(), c.laddr.ip) for p in processes if p.is_running()
                 for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    names = {name for name, _ in listening}
    assert "gcs_server" in names and "raylet" in names, listening
    assert all(ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for _, ip in listening), listening
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    ray.kill(probe)


def test_a_formed_two_worker_group_listens_on_loopback_only(ray_cluster, tiny_pixel_path):
    """Once two actor ranks have joined their torch.distributed group (the store rank 0 serves,
    gloo's pairs), every socket any process of this cluster listens on is loopback: the group
    binds its store to the loopback address the node has, not to every interface."""
    import psutil

    from pixelrl.config import load_config
    from pixelrl.core.config_io import to_yaml
    from pixelrl.workers.group import RayWorkerGroup

    cfg = load_config("flow_grpo_tiny", [f"model.path={tiny_pixel_path}", "trainer.n_workers=2"])
    group = RayWorkerGroup(to_yaml(cfg), 2, 1)
    try:
        ranks = ray_actor_pids("PolicyWorker")
        processes = [psutil.Process(), *psutil.Process().children(recursive=True)]
        listening = [(p.pid, c.laddr.ip, c.laddr.port) for p in processes if p.is_running()
                     for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        assert {pid for pid, *_ in listening} & ranks, listening  # the ranks do listen (store, gloo)
        assert all(ip in ("127.0.0.1", "::ffff:127.0.0.1", "::1") for _, ip, _ in listening), listening
    finally:
        group.shutdown()


def test_crash_lines_of_a_heap_corruption_abort_by_hand():
    """The stderr of a worker that glibc aborted (as recorded in this project's CI): the heap
    message, the signal report once although Ray prints it twice, and Python's fatal error; the
    stack addresses and the list of extension modules are left out."""
    from pixelrl.workers.group import crash_lines

    log = """:job_id:01000000
:actor_name:VLMWorker
malloc(): unaligned tcache chunk detected
*** SIGABRT received at time=1795660062 on cpu 1 ***
PC: @     0x7f9fc4ca8eec  (unknown)  (unknown)
    @     0x7f9fc4c5a050       9104  (unknown)
[2026-11-26 02:27:42,834 E 29635 29689] logging.cc:474: *** SIGABRT received at time=1795660062 on cpu 1 ***
[2026-11-26 02:27:42,834 E 29635 29689] logging.cc:474: PC: @     0x7f9fc4ca8eec  (unknown)  (unknown)
[2026-11-26 02:27:42,834 E 29635 29689] logging.cc:474:     @     0x7f9fc4c5a050       9104  (unknown)
Fatal Python error: Aborted

Extension modules: msgpack._cmsgpack, google._upb._message, psutil._psutil_linux (total: 3)
"""
    assert crash_lines(log) == ["malloc(): unaligned tcache chunk detected",
                                "*** SIGABRT received at time=1795660062 on cpu 1 ***",
                                "PC: @     0x7f9fc4ca8eec  (unknown)  (unknown)",
                                "Fatal Python error: Aborted"]
    assert crash_lines(":job_id:01000000\n:actor_name:VLMWorker\n") == []


def test_a_colocated_reward_worker_sees_no_gpu(ray_cluster):
    """Ray leaves CUDA_VISIBLE_DEVICES as it finds it for an actor without GPUs: on a GPU node a
    colocated reward worker would load its model onto the first card, beside a policy worker.
    pixelrl hides the GPUs from it (a reward pool with num_gpus gets its own)."""
    import os

    import ray

    from pixelrl.workers.group import RewardGroup

    group = RewardGroup([{"name": "jpeg_compressibility", "weight": 1.0}], backend="ray", placement="colocated")
    try:
        seen = ray.get(group.workers[0].__ray_call__.remote(lambda worker: os.environ.get("CUDA_VISIBLE_DEVICES")))
    finally:
        group.shutdown()
    assert seen == ""


@pytest.mark.slow  # ~2 min: both workers compile
def test_compiled_blocks_under_fsdp2_train_as_the_eager_blocks(ray_cluster, tiny_pixel_path):
    """model.compile with FSDP2 on two workers (blocks compiled after sharding, as torchtitan
    orders it), and with gradient checkpointing, which the `auto` sizes choose for FLUX on 8 GPUs:
    after one update both ranks agree and hold what the eager, unchecked run holds, up to float
    reordering."""
    import numpy as np

    from pixelrl.core.config_io import to_yaml
    from pixelrl.config import load_config
    from pixelrl.testing import transition_step
    from pixelrl.workers.group import RayWorkerGroup, RewardGroup

    def compiled_graphs(worker) -> int:  # defined here: Ray ships it by value to the workers
        from torch._dynamo.utils import counters

        return counters["stats"]["unique_graphs"]

    states, graphs = [], []
    for compiled in (False, True):
        cfg = load_config("flow_grpo_tiny", [f"model.path={tiny_pixel_path}", "trainer.n_workers=2",
                                             "trainer.strategy=fsdp2", f"model.compile={str(compiled).lower()}",
                                             f"model.gradient_checkpointing={str(compiled).lower()}",
                                             "actor.lr=1e-3", "algorithm.drop_zero_advantage=false"])
        rewards = RewardGroup([dict(f) for f in cfg.reward.functions], backend="local")
        group = RayWorkerGroup(to_yaml(cfg), 2, 1)
        try:
            start = group.trainable_states()[0]
            transition_step(group, rewards, ["a red circle", "a cat", "a tree", "a car"], [{}] * 4, 1, cfg,
                            uids=list("abcd"), num_workers=2)
            states.append(group.trainable_states())
            graphs.append(group.call("__ray_call__", None, compiled_graphs, gather="all"))
        finally:
            group.shutdown()
    assert graphs[0] == [0, 0] and min(graphs[1]) > 0  # the compiled run did compile, on both ranks
    (eager, _), (rank0, rank1) = states
    assert all(np.array_equal(rank0[k], rank1[k]) for k in rank0)
    moved = max(float(np.abs(eager[k] - start[k]).max()) for k in eager)
    apart = max(float(np.abs(rank0[k] - eager[k]).max()) for k in eager)
    assert moved > 1e-4 and apart < 1e-2 * moved


def test_the_local_cluster_keeps_token_authentication_without_its_note(monkeypatch, caplog):
    """Ray notes at every start that it turned token authentication on by default, the first line a
    demo printed: pixelrl leaves that note out while Ray starts, and only that one; Ray's INFO
    lines (`Started a local Ray instance.`) are left out by its own logging level."""
    import logging

    import ray

    from pixelrl.workers import local_ray

    note = logging.getLogger(local_ray._AUTH_LOGGER)

    started_with = {}

    def init(**kwargs):
        started_with.update(kwargs)
        note.warning("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled to opt out.")
        note.warning("Token authentication is enabled but no authentication token was found")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(local_ray, "_start_watchdog", lambda: None)
    # Ray's loggers propagate to the root (where caplog listens) only once Ray has set them up:
    # listen on the logger itself, and only there, however the tests before set it up
    propagates = note.propagate
    note.propagate = False
    note.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger=local_ray._AUTH_LOGGER):
            local_ray.start_local_ray(1)
            note.warning("Token authentication is enabled for this Ray cluster.")  # after the start: shown
    finally:
        note.removeHandler(caplog.handler)
        note.propagate = propagates
    assert [r.getMessage()[:60] for r in caplog.records] == [
        "Token authentication is enabled but no authentication token ", "Token authentication is enabled for this Ray cluster."]
    assert started_with["logging_level"] == logging.WARNING
