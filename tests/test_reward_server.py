"""`pixelrl serve-reward` and the `remote` reward, on loopback only: the token, size limits,
malformed and pickled payloads, timeouts, retries, 1,000 requests in a row, and a training run
scored through the server equal to one scored in-process."""

import base64
import json
import pickle
import socket
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from conftest import read_metrics, train_cli
from pixelrl.cli import main
from pixelrl.core.errors import ConfigError, RewardError
from pixelrl.rewards import WeightedReward, get_reward
from pixelrl.rewards.server import RewardServer, is_loopback
from pixelrl.rewards.wire import PROTOCOL, Limits, encode_request

TOKEN = "a-test-token-of-24-chars"


def images(batch, size=8, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (batch, size, size, 3), dtype=np.uint8))


def post(url, body: bytes, content_type="application/json", token=None):
    """(status, decoded answer) of a raw POST /score."""
    headers = {"Content-Type": content_type}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "/score", body, headers), timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def remote(url, **options):
    return get_reward("remote", url=url, **options)


def test_scores_through_the_server_equal_the_reward_in_process_for_both_encodings():
    batch = images(5)
    local = get_reward("jpeg_compressibility", scale=0.5)(batch, ["p"] * 5, [{}] * 5)["jpeg_compressibility"]
    with RewardServer("jpeg_compressibility", {"scale": 0.5}) as server:
        for encoding in ("png", "raw"):
            # batch_size 2 splits the 5 images over 3 requests, reassembled in order
            out = remote(server.url, encoding=encoding, batch_size=2)(batch, ["p"] * 5, [{"i": i} for i in range(5)])
            assert torch.equal(out["remote"], local), encoding
        assert server.requests_scored == 6
        with urllib.request.urlopen(server.url + "/health", timeout=10) as answer:
            assert json.loads(answer.read()) == {"status": "ok", "protocol": PROTOCOL}


def test_an_edits_sources_travel_to_a_server_reward_that_reads_them():
    """remote(send_sources=True) sends each row's sources as PNG: the server's source_preservation
    scores what it scores in process (two requests, for both encodings of the edits); without
    them the server names the option; the sources count toward the request's pixel limit; the
    start-up check sees a remote that sends sources as a reward reading them."""
    from pixelrl.rewards.remote import remote as remote_factory

    edits, sources = images(3, seed=1), [(s,) for s in images(3, seed=2)]
    sources[1] = (sources[1][0], images(1, seed=3)[0])  # a row may hold several sources; the reward reads the first
    local = get_reward("source_preservation")(edits, ["p"] * 3, [{}] * 3, condition_images=sources)
    with RewardServer("source_preservation") as server:
        for encoding in ("png", "raw"):
            fn = remote(server.url, send_sources=True, encoding=encoding, batch_size=2)
            assert fn.reads_condition_images
            out = fn(edits, ["p"] * 3, [{}] * 3, condition_images=sources)
            assert torch.equal(out["remote"], local["source_preservation"]), encoding
        with pytest.raises(RewardError, match="send_sources: true"):
            remote(server.url, retries=0)(edits, ["p"] * 3, [{}] * 3)
        body = encode_request(edits.numpy(), ["p"] * 3, [{}] * 3, sources=[(s[0].numpy(),) for s in sources])
        assert post(server.url, body)[0] == 200
        # rows whose sources differ in size (a client's own edits) are each scored, not a 500
        mixed = [sources[0], (np.repeat(np.repeat(sources[1][0].numpy(), 2, 0), 2, 1),), sources[2]]
        status, answer = post(server.url, encode_request(edits.numpy(), ["p"] * 3, [{}] * 3,
                                                         sources=[(np.asarray(s[0]),) for s in mixed]))
        assert status == 200, answer
        assert answer["scores"]["source_preservation"] == pytest.approx(local["source_preservation"].tolist(), abs=1e-6)
    with RewardServer("source_preservation", limits=Limits(max_total_pixels=3 * 64 + 2 * 64)) as server:
        status, answer = post(server.url, body)  # 3 edits and 3 sources of 8 x 8: 384 pixels
        assert status == 413 and "pixels in all" in answer["error"]
    assert remote_factory.reads_condition_images({"send_sources": True})
    assert not remote_factory.reads_condition_images({"url": "http://127.0.0.1:1"})
    with pytest.raises(ConfigError, match="send_sources"):
        remote("http://127.0.0.1:8765", send_sources="yes")


def test_a_request_without_the_token_is_refused(monkeypatch):
    body = encode_request(images(1).numpy(), ["p"], [{}])
    with RewardServer("jpeg_compressibility", token=TOKEN) as server:
        assert post(server.url, body)[0] == 401
        assert post(server.url, body, token="wrong-token-wrong-token")[0] == 401
        assert post(server.url, body, token=TOKEN)[0] == 200
        monkeypatch.delenv("PIXELRL_REWARD_TOKEN", raising=False)
        with pytest.raises(RewardError, match=r"answered 401.*PIXELRL_REWARD_TOKEN"):
            remote(server.url, retries=0)(images(1), ["p"], [{}])
        monkeypatch.setenv("PIXELRL_REWARD_TOKEN", TOKEN)
        assert remote(server.url)(images(1), ["p"], [{}])["remote"].shape == (1,)
        assert server.requests_scored == 2


def test_a_token_put_in_the_url_is_never_logged_or_answered_back(capsys):
    """A client that puts its token in the query string gets a 400 saying where the token goes;
    neither the server's log line nor its answer repeats the URL's query."""
    body = encode_request(images(1).numpy(), ["p"], [{}])
    secret = "the-secret-token-in-a-url"
    with RewardServer("jpeg_compressibility", token=TOKEN) as server:
        for method, path, data in (("POST", f"/score?token={secret}", body), ("GET", f"/health?token={secret}", None),
                                   ("GET", f"/nowhere?token={secret}", None)):
            request = urllib.request.Request(server.url + path, data, {"Content-Type": "application/json"},
                                             method=method)
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(request, timeout=10)
            answer = err.value.read().decode()
            assert err.value.code == 400 and "Authorization header" in answer and secret not in answer, answer
        assert server.requests_scored == 0
    logged = capsys.readouterr().out
    assert "reward server: 400" in logged and secret not in logged, logged


def test_oversized_requests_are_refused_before_scoring():
    with RewardServer("jpeg_compressibility", max_request_mb=0.01, limits=Limits(max_images=3, max_pixels=32 * 32)) as server:
        big = encode_request(images(1, size=128).numpy(), ["p"], [{}], encoding="raw")  # 49 kB > 10 kB
        status, answer = post(server.url, big)
        assert status == 413 and "over this server's" in answer["error"]
        status, answer = post(server.url, encode_request(images(4).numpy(), ["p"] * 4, [{}] * 4))
        assert status == 413 and "4 images" in answer["error"]
        status, answer = post(server.url, encode_request(images(1, size=40).numpy(), ["p"], [{}]))
        assert status == 413 and "40x40" in answer["error"]
        assert server.requests_scored == 0
        with pytest.raises(RewardError, match="413"):
            remote(server.url, batch_size=4)(images(4), ["p"] * 4, [{}] * 4)


@pytest.mark.parametrize("images_field, message", [
    ({"encoding": "png", "data": [base64.b64encode(b"not a png").decode()]}, "is not a PNG image"),
    ({"encoding": "png", "data": ["%%% not base64"]}, "not valid base64"),
    ({"encoding": "raw", "shape": [1, 8, 8, 3], "data": base64.b64encode(b"x" * 10).decode()}, "holds 10 bytes"),
    ({"encoding": "raw", "shape": [1, 8, 8, 4], "data": ""}, "images.shape"),
    ({"encoding": "gif", "data": []}, "encoding one of"),
])
def test_malformed_images_are_a_clear_error(images_field, message):
    body = json.dumps({"protocol": PROTOCOL, "prompts": ["p"], "metadata": [{}], "images": images_field}).encode()
    with RewardServer("jpeg_compressibility") as server:
        status, answer = post(server.url, body)
        assert status == 400 and message in answer["error"]
        assert server.requests_scored == 0


class _WritesAFileWhenUnpickled:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def test_a_pickled_payload_is_refused_and_never_unpickled(tmp_path):
    marker = tmp_path / "unpickled"
    payload = pickle.dumps({"images": _WritesAFileWhenUnpickled(str(marker)), "prompts": ["p"]})
    with RewardServer("jpeg_compressibility") as server:
        status, answer = post(server.url, payload, content_type="application/octet-stream")
        assert status == 415 and "never pickle" in answer["error"]
        status, answer = post(server.url, payload)  # claiming to be JSON does not help
        assert status == 400 and "not JSON" in answer["error"]
    assert not marker.exists()


def test_a_scorer_error_fails_closed_with_the_servers_message():
    with RewardServer("ocr") as server:  # a prompt without quoted text makes the OCR reward raise
        with pytest.raises(RewardError, match="answered 500.*between double quotes"):
            remote(server.url, retries=3, backoff_s=0)(images(1), ["no quoted text"], [{}])
        assert server.requests_scored == 0


def test_a_slow_server_times_out_and_the_reward_stops_the_step():
    with RewardServer("delayed", {"seconds_per_image": 1.0}) as server:
        reward = WeightedReward.from_functions([{"name": "remote", "options": {
            "url": server.url, "timeout_s": 0.2, "retries": 1, "backoff_s": 0}}])
        with pytest.raises(RewardError, match=r"failed 2 time\(s\), last: no answer within timeout_s=0.2 s"):
            reward(images(1), ["p"], [{}])


def test_an_unreachable_server_is_named():
    url = f"http://127.0.0.1:{unused_port()}"
    with pytest.raises(RewardError, match=f"reward server {url} failed 3 time.*cannot connect"):
        remote(url, retries=2, backoff_s=0)(images(1), ["p"], [{}])


def test_503_is_retried_with_backoff_and_then_reported():
    answers = {"left_to_refuse": 2, "seen": 0}

    class Flaky(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            answers["seen"] += 1
            refuse = answers["left_to_refuse"] > 0
            answers["left_to_refuse"] -= 1
            body = json.dumps({"error": "warming up"} if refuse else {"scores": {"s": [0.25]}}).encode()
            self.send_response(503 if refuse else 200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        assert remote(url, retries=2, backoff_s=0.01)(images(1), ["p"], [{}])["remote"].tolist() == [0.25]
        assert answers["seen"] == 3
        answers["left_to_refuse"] = 5
        with pytest.raises(RewardError, match="failed 2 time.*503: warming up"):
            remote(url, retries=1, backoff_s=0.01)(images(1), ["p"], [{}])
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_thousand_requests_in_a_row_lose_none():
    reward = get_reward("jpeg_compressibility")
    with RewardServer("jpeg_compressibility") as server:
        client = remote(server.url, retries=0)
        for i in range(1000):
            batch = images(2, size=4, seed=i)
            assert torch.equal(client(batch, ["p", "q"], [{}, {}])["remote"],
                               reward(batch, ["p", "q"], [{}, {}])["jpeg_compressibility"]), i
        assert server.requests_scored == 1000


def test_settings_are_checked_before_anything_listens(monkeypatch):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("reward-host")  # names are never resolved
    with pytest.raises(ConfigError, match="--host.*needs a token"):
        RewardServer("jpeg_compressibility", host="0.0.0.0")
    with pytest.raises(ConfigError, match="--token-env.*at least 16"):
        RewardServer("jpeg_compressibility", token="short")
    for options, field in (({}, "url"), ({"url": "ftp://127.0.0.1:1"}, "url"), ({"url": "http://127.0.0.1:1/score"}, "url"),
                           ({"url": "http://127.0.0.1:1", "timeout_s": 0}, "timeout_s"),
                           ({"url": "http://127.0.0.1:1", "retries": -1}, "retries"),
                           ({"url": "http://127.0.0.1:1", "encoding": "jpeg"}, "encoding")):
        with pytest.raises(ConfigError, match=f"options.{field}"):
            get_reward("remote", **options)
    monkeypatch.delenv("PIXELRL_REWARD_TOKEN", raising=False)
    assert main(["serve-reward", "--reward", "jpeg_compressibility", "--host", "0.0.0.0"]) == 2
    assert main(["serve-reward", "--reward", "jpeg_compressibility", "--reward-options", '{"nope": 1}']) == 2


def test_training_scored_by_the_server_equals_training_scored_in_process(tmp_path, tiny_pixel_path):
    run = ("trainer.backend=local", "trainer.logger=[jsonl]", "data.train_batch_size=2", "actor.ppo_mini_batch_size=4",
           "trainer.total_training_steps=2", "trainer.save_freq=-1")
    code, local_run = train_cli(tmp_path / "local", tiny_pixel_path, *run,
                                "reward.functions=[{name: jpeg_compressibility, options: {scale: 0.002}}]")
    assert code == 0
    with RewardServer("jpeg_compressibility", {"scale": 0.002}) as server:
        code, remote_run = train_cli(tmp_path / "remote", tiny_pixel_path, *run,
                                     f"reward.functions=[{{name: remote, options: {{url: '{server.url}'}}}}]")
        assert code == 0 and server.requests_scored > 0
    local_rewards = [m["critic/rewards/mean"] for m in read_metrics(local_run)]
    remote_rewards = [m["critic/rewards/mean"] for m in read_metrics(remote_run)]
    assert len(local_rewards) == 2 and remote_rewards == local_rewards
    # an unreachable server stops the run with the server named, exit code 2
    code, _ = train_cli(tmp_path / "down", tiny_pixel_path, *run, "reward.functions=[{name: remote, options: "
                        f"{{url: 'http://127.0.0.1:{unused_port()}', retries: 0}}}}]")
    assert code == 2
