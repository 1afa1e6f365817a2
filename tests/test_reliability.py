"""Failures that used to pass silently or lose work: a reward client that follows a redirect with
its token, a server that trickles its answer, a reward that calls sys.exit, a validation that
fails after training, a prompt file with a byte-order mark."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from conftest import read_metrics, train_cli
from pixelrl.core.errors import RewardError
from pixelrl.rewards import get_reward


def _serve(handler_cls):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler_cls)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


def _images(batch=1):
    return torch.from_numpy(np.zeros((batch, 8, 8, 3), dtype=np.uint8))


class _Quiet(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_the_remote_client_never_follows_a_redirect_with_its_token(monkeypatch):
    """A server answering 302 elsewhere: the client stops with a message naming the redirect, and
    the other address receives neither the token nor the batch (urllib would have followed it)."""
    seen = []

    class Elsewhere(_Quiet):
        def do_POST(self):
            seen.append(self.headers.get("Authorization"))
            body = json.dumps({"scores": {"s": [9.0]}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    other, other_url = _serve(Elsewhere)

    class Redirecting(_Quiet):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(307)  # 307 keeps the method and the body
            self.send_header("Location", other_url + "/score")
            self.send_header("Content-Length", "0")
            self.end_headers()

    server, url = _serve(Redirecting)
    monkeypatch.setenv("PIXELRL_REWARD_TOKEN", "a-test-token-of-24-chars")
    try:
        with pytest.raises(RewardError, match="answered 307, a redirect to .*does not follow redirects"):
            get_reward("remote", url=url, retries=0)(_images(), ["p"], [{}])
        assert seen == []
    finally:
        for httpd in (server, other):
            httpd.shutdown()
            httpd.server_close()


def test_a_server_that_trickles_its_answer_hits_the_whole_request_deadline():
    """timeout_s bounds the whole request: a byte every 0.2 s keeps each socket read under the
    timeout, and used to keep the client waiting for as long as the server liked."""

    class Trickle(_Quiet):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = json.dumps({"scores": {"s": [0.5]}}).encode() + b" " * 200
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            for byte in body:
                try:
                    self.wfile.write(bytes([byte]))
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.2)

    server, url = _serve(Trickle)
    try:
        start = time.monotonic()
        with pytest.raises(RewardError, match="took more than timeout_s=1.0 s in all"):
            get_reward("remote", url=url, timeout_s=1.0, retries=0)(_images(), ["p"], [{}])
        assert time.monotonic() - start < 5  # the body alone would take 40 s
    finally:
        server.shutdown()
        server.server_close()


def test_a_reward_that_calls_sys_exit_fails_like_any_reward_error():
    """SystemExit from a reward used to pass through the trainer and the CLI: exit 0, no checkpoint."""
    import sys

    from pixelrl.rewards.multi import _call

    def quits(images, prompts, metadata):
        sys.exit(0)

    with pytest.raises(RewardError, match="reward `quits` raised SystemExit"):
        _call("quits", quits, _images(), ["p"], [{}])


def test_a_byte_order_mark_is_not_part_of_the_first_prompt(tmp_path):
    from pixelrl.data.prompts import read_prompt_file

    txt = tmp_path / "prompts.txt"
    txt.write_bytes("\ufeffa red circle\na cat\n".encode("utf-8"))
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_bytes(("\ufeff" + json.dumps({"prompt": "a red circle"}) + "\n").encode("utf-8"))
    for path in (txt, jsonl):
        assert read_prompt_file(path)[0]["prompt"] == "a red circle"


def test_a_validation_that_fails_after_training_keeps_the_final_checkpoint(tmp_path, tiny_sd3_path, monkeypatch):
    """The last step's validation raising (here: a validation generator that breaks) used to end
    the run before its final save: every trained step was lost. Now the step is saved, its row
    logged, and the error still stops the run."""
    from pixelrl.trainers.controller import DiffusionTrainer

    def broken(self, val_set, step, tracker):
        raise RuntimeError("validation broke")

    monkeypatch.setattr(DiffusionTrainer, "validate", broken)
    val = tmp_path / "val.txt"
    val.write_text("a red circle\n")
    with pytest.raises(RuntimeError, match="validation broke"):
        train_cli(tmp_path, tiny_sd3_path, "trainer.backend=local", "trainer.n_workers=1", "data.train_batch_size=2",
                  "rollout.n=2", "rollout.num_steps=4", "trainer.total_training_steps=2", f"data.val_files=[{val}]",
                  "trainer.logger=[jsonl]")
    run = tmp_path / "pixelrl" / "flow_grpo_tiny"
    assert (run / "checkpoints" / "global_step_2").is_dir()
    assert [row["step"] for row in read_metrics(run)] == [1, 2]


TINY_RUN = ("trainer.backend=local", "trainer.n_workers=1", "data.train_batch_size=2", "rollout.n=2",
            "rollout.num_steps=4", "trainer.logger=[jsonl]", "data.val_files=[]")


def test_a_second_run_in_a_folder_in_use_is_refused_and_writes_nothing(tmp_path, tiny_sd3_path, capsys):
    from pixelrl.trainers.run_folder import RunFolderLock

    run = tmp_path / "pixelrl" / "flow_grpo_tiny"
    first = RunFolderLock(run)
    first.acquire()  # the first run, still training
    try:
        code, _ = train_cli(tmp_path, tiny_sd3_path, *TINY_RUN, "trainer.total_training_steps=1")
    finally:
        first.release()
    assert code == 2
    assert "another pixelrl run is training in this folder" in capsys.readouterr().err
    assert not (run / "metrics.jsonl").exists() and not (run / "checkpoints").exists()
    code, _ = train_cli(tmp_path, tiny_sd3_path, *TINY_RUN, "trainer.total_training_steps=1")
    assert code == 0  # released when the first run ends


def test_a_fresh_start_over_another_runs_checkpoints_is_refused(tmp_path, tiny_sd3_path, capsys):
    code, run = train_cli(tmp_path, tiny_sd3_path, *TINY_RUN, "trainer.total_training_steps=2", "trainer.save_freq=1")
    assert code == 0
    before = (run / "checkpoints" / "global_step_1" / "trainer_state.json").read_bytes()
    code, _ = train_cli(tmp_path, tiny_sd3_path, *TINY_RUN, "trainer.total_training_steps=1", "trainer.resume_mode=disable")
    assert code == 2 and "holds checkpoints of an earlier run" in capsys.readouterr().err
    assert (run / "checkpoints" / "global_step_1" / "trainer_state.json").read_bytes() == before
    assert (run / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def test_rows_of_a_run_killed_before_its_first_checkpoint_are_not_doubled(tmp_path, tiny_sd3_path):
    """Killed between logging step 1 and saving it: the re-run starts from scratch and its step 1
    row replaces the old one (docs/runtime.md: no row is ever doubled)."""
    run = tmp_path / "pixelrl" / "flow_grpo_tiny"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "critic/rewards/mean": -9.0}) + "\n")
    code, _ = train_cli(tmp_path, tiny_sd3_path, *TINY_RUN, "trainer.total_training_steps=2")
    assert code == 0
    rows = read_metrics(run)
    assert [row["step"] for row in rows] == [1, 2] and rows[0]["critic/rewards/mean"] != -9.0


def test_the_reward_server_checks_a_requests_total_pixels_before_decoding_any():
    """12 black 4096 x 4096 PNGs are 0.75 MB on the wire and 600 MB decoded: refused from their
    headers (413) under the default budget, before any image is decoded."""
    import base64
    import io

    from PIL import Image

    from pixelrl.rewards.wire import PROTOCOL, Limits, WireError, decode_request

    buffer = io.BytesIO()
    Image.new("RGB", (4096, 4096)).save(buffer, format="PNG")
    png = base64.b64encode(buffer.getvalue()).decode()
    body = json.dumps({"protocol": PROTOCOL, "prompts": ["p"] * 12, "metadata": [{}] * 12,
                       "images": {"encoding": "png", "data": [png] * 12}}).encode()
    with pytest.raises(WireError, match="pixels in all, over this server's") as caught:
        decode_request(body)
    assert caught.value.status == 413
    assert decode_request(body, Limits(max_total_pixels=12 * 4096 * 4096))[0].shape == (12, 4096, 4096, 3)


def test_deeply_nested_json_is_a_clear_400_not_a_crash():
    from pixelrl.rewards.wire import WireError, decode_request

    with pytest.raises(WireError, match="nested too deeply"):
        decode_request(b"[" * 100_000 + b"]" * 100_000)


def test_idle_connections_past_the_cap_are_closed_and_valid_requests_still_score():
    import socket

    from pixelrl.rewards.server import RewardServer

    with RewardServer("jpeg_compressibility", max_connections=2) as server:
        host, port = server.url.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port))) for _ in range(2)]  # hold both slots, send nothing
        extra = socket.create_connection((host, int(port)))
        extra.settimeout(5)
        assert extra.recv(1) == b""  # closed at once instead of held open
        extra.close()
        for s in idle:
            s.close()
        # the server sees the closed sockets and frees their slots; retries cover the moment before
        scores = get_reward("remote", url=server.url, retries=5, backoff_s=0.1)(_images(), ["p"], [{}])
        assert scores["remote"].shape == (1,)


TORCH_OOM = ("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
             "3.12 GiB is free. Of the allocated memory 70.1 GiB is allocated by PyTorch.")


@pytest.mark.parametrize("verb, phase, knob", [("rollout", "sampling", "rollout.micro_batch_size"),
                                               ("update", "update", "actor.ppo_micro_batch_size")])
def test_running_out_of_memory_names_the_phase_and_the_knob_and_keeps_the_run(tmp_path, tiny_sd3_path, capsys,
                                                                              monkeypatch, verb, phase, knob):
    """torch.cuda.OutOfMemoryError injected into a phase of step 2: one message (no traceback) with
    torch's figures and the setting to lower; step 1's checkpoint and row stay."""
    from pixelrl.engine.policy_engine import PolicyEngine

    code, run = train_cli(tmp_path, tiny_sd3_path, *TINY_RUN, "trainer.total_training_steps=1")
    assert code == 0

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError(TORCH_OOM)

    monkeypatch.setattr(PolicyEngine, verb, out_of_memory)
    capsys.readouterr()
    code, _ = train_cli(tmp_path, tiny_sd3_path, *TINY_RUN, "trainer.total_training_steps=2")
    printed = capsys.readouterr()
    assert code == 2, printed
    assert f"out of device memory while {phase}: CUDA out of memory. Tried to allocate 20.00 GiB" in printed.err
    assert "3.12 GiB is free" in printed.err and knob in printed.err and "Traceback" not in printed.err
    assert (run / "checkpoints" / "global_step_1").is_dir() and [r["step"] for r in read_metrics(run)] == [1]


def test_every_phase_has_its_knob():
    from pixelrl.engine.memory import KNOBS, OutOfMemory, naming_the_phase

    for phase in KNOBS:
        with pytest.raises(OutOfMemory, match=f"while {phase}: CUDA out of memory"):
            with naming_the_phase(phase):
                raise torch.cuda.OutOfMemoryError(TORCH_OOM)


def test_the_vlm_trainer_also_saves_the_step_before_a_failed_validation_stops_it(tiny_vlm_path, tmp_path,
                                                                                  monkeypatch):
    from conftest import vlm_config
    from pixelrl.vlm.trainer import VLMPPOTrainer

    def broken(self):
        raise RuntimeError("validation broke")

    monkeypatch.setattr(VLMPPOTrainer, "validate", broken)
    # validating every step, saving only at the last: step 1's failed validation saves step 1 off schedule
    cfg = vlm_config(tiny_vlm_path, tmp_path, "trainer.total_training_steps=2", "trainer.test_freq=1",
                     "trainer.save_freq=0")
    trainer = VLMPPOTrainer(cfg)
    with pytest.raises(RuntimeError, match="validation broke"):
        trainer.fit()
    assert (trainer.ckpt_root / "global_step_1").is_dir()
    assert [row["step"] for row in read_metrics(trainer.run_dir)] == [1]


def test_lora_targets_the_denoiser_does_not_have_are_named_with_its_layers(tmp_path, tiny_sd3_path, capsys):
    """peft's own error was a traceback from inside the worker; the message now names the field
    and the denoiser's linear layers to choose from."""
    code, _ = train_cli(tmp_path, tiny_sd3_path, *TINY_RUN, "trainer.total_training_steps=1",
                        "model.lora_target_modules=[nope]")
    err = capsys.readouterr().err
    assert code == 2 and "model.lora_target_modules" in err and "to_q" in err and "Traceback" not in err


def test_a_ray_address_where_no_cluster_answers_is_named_at_once():
    """What ensure_ray checks before ray.init joins a given address (a Ray session another test
    left running would skip ensure_ray's join, so the check is called as ensure_ray calls it)."""
    from pixelrl.core.errors import ConfigError
    from pixelrl.workers.group import check_cluster_answers

    start = time.monotonic()
    with pytest.raises(ConfigError, match="trainer.ray_address.*no Ray cluster answers there"):
        check_cluster_answers("127.0.0.1:1")
    assert time.monotonic() - start < 15
    check_cluster_answers("auto")  # Ray resolves these itself


def test_more_gpu_workers_than_this_machines_gpus_are_refused_before_ray_waits_for_them(monkeypatch, tmp_path,
                                                                                       tiny_vlm_path):
    """A Ray cluster started on this machine has its GPUs only: a placement group of one GPU per
    worker beyond them would wait forever. `pixelrl train` refuses it at start-up, before the run
    folder exists, with the worker count that fits, for the diffusion and the vision-language
    trainers; a named cluster is not second-guessed."""
    from pixelrl.config import load_config
    from pixelrl.core.errors import ConfigError

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    run = ["model.device=cuda", f"trainer.default_local_dir={tmp_path}"]
    with pytest.raises(ConfigError, match=r"trainer.n_workers` = 2.*has 1 GPU.*set trainer.n_workers=1 .*"
                                          r"trainer.backend=local for one GPU"):
        load_config("shapes_flow_grpo", run)
    with pytest.raises(ConfigError, match=r"1 actor worker\(s\) and 1 rollout worker\(s\).*on one GPU train "
                                          r"with trainer.mode=sync and rollout.n_workers=0"):
        load_config("shapes_flow_grpo", [*run, "trainer.n_workers=1", "rollout.n_workers=1",
                                         "trainer.mode=one_step_off"])
    assert not any(tmp_path.iterdir())
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    with pytest.raises(ConfigError, match=r"has 4 GPU\(s\).*set trainer.n_workers=4 \(`pixelrl plan --gpus 4`"):
        load_config("flow_grpo_sd35", ["model.path=" + str(tmp_path), "model.device=cuda"])
    with pytest.raises(ConfigError, match=r"set trainer.n_workers=3 \(`pixelrl plan --gpus 3`"):
        load_config("shapes_flow_grpo", [*run, "trainer.n_workers=4", "rollout.n_workers=1",
                                         "trainer.mode=one_step_off"])
    assert load_config("shapes_flow_grpo", [*run, "trainer.n_workers=4"]).trainer.n_workers == 4
    assert load_config("shapes_flow_grpo", [*run, "trainer.n_workers=8", "trainer.ray_address=10.0.0.1:6379"])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"each of the 2 actor worker\(s\) takes a GPU.*has 1 GPU"):
        load_config("vlm_grpo_shapes_qa", [f"model.path={tiny_vlm_path}", *run])


def test_a_connection_must_send_its_headers_in_time_and_without_the_token_cannot_stay_open():
    """Slow or idle clients cannot hold the server's connections: the request line and headers
    must arrive within header_timeout_s however slowly bytes trickle in, and a request without
    the token (even an answered GET /health) closes its connection."""
    import socket
    import time

    from pixelrl.rewards.server import RewardServer

    with RewardServer("jpeg_compressibility", token="a-token-of-24-characters", header_timeout_s=1.0) as server:
        host, port = server.url.removeprefix("http://").split(":")
        idle = socket.create_connection((host, int(port)))
        idle.settimeout(10)
        began = time.monotonic()
        assert idle.recv(1) == b"" and time.monotonic() - began < 5  # dropped at the deadline
        trickle = socket.create_connection((host, int(port)))
        trickle.settimeout(0.2)
        began, dropped = time.monotonic(), False
        for byte in b"POST /score HTTP/1.1\r\nHost: x\r\n":  # one byte every 0.2 s: each read in time
            try:
                trickle.send(bytes([byte]))
                if trickle.recv(1) == b"":
                    dropped = True
                    break
            except socket.timeout:
                continue
            except OSError:
                dropped = True
                break
        assert dropped and time.monotonic() - began < 5
        health = socket.create_connection((host, int(port)))
        health.settimeout(5)
        health.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        while chunk := health.recv(4096):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200") and b"Connection: close" in answer  # then closed (recv gave b"")
        for s in (idle, trickle, health):
            s.close()
