"""`remote`: scores from a `pixelrl serve-reward` server over HTTP (JSON, never pickle).

The batch goes out in requests of at most `batch_size` images. A connection failure, a timeout
or a 502/503/504 is retried `retries` times with exponential backoff; anything else, and
exhausted retries, stop the step with a RewardError that names the server and the cause. A
failed request never turns into a zero reward.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import torch

from pixelrl.core.errors import ConfigError, RewardError
from pixelrl.rewards.registry import check_number_option, register_reward
from pixelrl.rewards.wire import ENCODINGS, WireError, decode_scores, encode_request

RETRIED_STATUSES = (502, 503, 504)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """urllib follows a redirect with the request's headers, the bearer token included: a server
    (or anything in between) answering 3xx would receive the token at another address and supply
    the scores. The client only talks to the address it was given; a 3xx becomes an HTTPError."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


class _PastDeadline(TimeoutError):
    pass


def _read_within(response, deadline: float, timeout_s: float) -> bytes:
    """The body, in chunks, failing once the whole request has taken `timeout_s`: the socket
    timeout bounds each read, so a server trickling a byte at a time would otherwise never time out."""
    chunks = []
    while True:
        chunk = response.read1(65536) if hasattr(response, "read1") else response.read(65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        if time.monotonic() > deadline:
            raise _PastDeadline(f"the answer took more than timeout_s={timeout_s} s in all")


def check_remote_options(options: dict, field: str) -> None:
    url = options.get("url", "")
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise ConfigError(f"{field}.url", url, "the reward server's address, e.g. http://127.0.0.1:8765 (scheme, host "
                                               "and port; the client adds /score)")
    check_number_option(options, field, "timeout_s", 1.0, lambda v: v > 0, "a number of seconds > 0")
    check_number_option(options, field, "backoff_s", 1.0, lambda v: v >= 0, "a number of seconds >= 0")
    check_number_option(options, field, "retries", 0, lambda v: v >= 0, "an integer >= 0", integer=True)
    check_number_option(options, field, "batch_size", 1, lambda v: v >= 1, "an integer >= 1", integer=True)
    if options.get("encoding", "png") not in ENCODINGS:
        raise ConfigError(f"{field}.encoding", options.get("encoding"), f"one of {list(ENCODINGS)}")
    if not isinstance(options.get("send_sources", False), bool):
        raise ConfigError(f"{field}.send_sources", options.get("send_sources"), "true (send each edit's source "
                          "images, for a server reward that reads them) or false")


@register_reward("remote")
def remote(url: str = "", key: str | None = None, token_env: str = "PIXELRL_REWARD_TOKEN", timeout_s: float = 60.0,
           retries: int = 3, backoff_s: float = 1.0, batch_size: int = 64, encoding: str = "png",
           send_sources: bool = False):
    """Scores of the server at `url`; `key` picks the main score when the server's reward returns several.
    `send_sources`: each edit's source images go with it (as PNG), for a server reward that reads
    them (`source_preservation`, `clip_source_similarity`)."""
    check_remote_options({"url": url, "timeout_s": timeout_s, "retries": retries, "backoff_s": backoff_s,
                          "batch_size": batch_size, "encoding": encoding, "send_sources": send_sources},
                         "reward.functions[].options")
    endpoint = url.rstrip("/") + "/score"

    def post(body: bytes) -> bytes:
        headers = {"Content-Type": "application/json"}
        token = os.environ.get(token_env)
        if token:
            headers["Authorization"] = f"Bearer {token}"
        last = ""
        for attempt in range(retries + 1):
            if attempt:
                time.sleep(backoff_s * 2 ** (attempt - 1))
            try:
                deadline = time.monotonic() + timeout_s
                with _OPENER.open(urllib.request.Request(endpoint, body, headers), timeout=timeout_s) as r:
                    return _read_within(r, deadline, timeout_s)
            except urllib.error.HTTPError as err:
                if 300 <= err.code < 400:
                    raise RewardError(f"reward server {url} answered {err.code}, a redirect to "
                                      f"{err.headers.get('Location')!r}: the client does not follow redirects (the "
                                      "token and the batch would go to another address); set url to the server "
                                      "itself") from None
                message = _server_message(err)
                if err.code not in RETRIED_STATUSES:
                    hint = f" (set ${token_env} to the server's token)" if err.code == 401 else ""
                    raise RewardError(f"reward server {url} answered {err.code}: {message}{hint}") from None
                last = f"{err.code}: {message}"
            except _PastDeadline as err:
                last = str(err)
            except (TimeoutError, socket.timeout):
                last = f"no answer within timeout_s={timeout_s} s"
            except urllib.error.URLError as err:
                reason = err.reason
                last = (f"no answer within timeout_s={timeout_s} s" if isinstance(reason, (TimeoutError, socket.timeout))
                        else f"cannot connect ({reason})")
            except (ConnectionError, OSError) as err:
                last = f"connection failed ({err})"
        raise RewardError(f"reward server {url} failed {retries + 1} time(s), last: {last}; is `pixelrl serve-reward` "
                          "running there? (the step stops rather than scoring 0)")

    def reward(images, prompts, metadata, condition_images=None):
        arrays = images.detach().cpu().numpy()
        parts: dict[str, list[torch.Tensor]] = {}
        for start in range(0, len(prompts), batch_size):
            end = start + batch_size
            sources = None if condition_images is None else [
                tuple(source.cpu().numpy() for source in row) for row in condition_images[start:end]]
            body = encode_request(arrays[start:end], prompts[start:end], metadata[start:end], encoding, sources)
            try:
                scores = decode_scores(post(body), len(prompts[start:end]))
            except WireError as err:
                raise RewardError(f"reward server {url}: {err}") from None
            for name, value in scores.items():
                parts.setdefault(name, []).append(value)
        out = {name: torch.cat(values) for name, values in parts.items()}
        main = key if key is not None else (next(iter(out)) if len(out) == 1 else None)
        if main not in out:
            raise RewardError(f"reward server {url} returned {sorted(out)}; name the main score with the remote "
                              f"reward's option `key`" + (f" (`{key}` is not among them)" if key else ""))
        return {"remote": out.pop(main), **{f"remote/{name}": value for name, value in out.items()}}

    reward.reads_condition_images = send_sources
    return reward


def _server_message(err: urllib.error.HTTPError) -> str:
    try:
        return str(json.loads(err.read())["error"])
    except Exception:
        return err.reason or "no message"


remote.check_options = check_remote_options
# the start-up check asks this of the config's options (a text-to-image run cannot send sources)
remote.reads_condition_images = lambda options: bool(options.get("send_sources", False))
