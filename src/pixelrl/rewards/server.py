"""`pixelrl serve-reward`: one registered reward behind HTTP, safe to expose.

Requests are JSON (see `pixelrl.rewards.wire`); nothing a request carries is executed or
unpickled. A bearer token is required unless the server listens on a loopback address only.
The body size is checked from Content-Length before anything is read, the socket read has a
timeout, the request line and headers must arrive within `header_timeout_s` (a connection cannot
sit idle or trickle bytes to hold a slot), only a request that presented the token keeps its
connection open, and scoring runs one request at a time (rewards hold models that are not
thread-safe).

    GET  /health -> {"status": "ok", "protocol": 1}
    POST /score  -> {"scores": {...}} | {"error": "..."} with 400 / 401 / 411 / 413 / 415 / 500
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from pixelrl.core.errors import ConfigError
from pixelrl.rewards.registry import check_reward_output, get_reward
from pixelrl.rewards.wire import PROTOCOL, Limits, WireError, decode_request, encode_scores

MIN_TOKEN_CHARS = 16


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback IP literals; names are not resolved (no lookup, no guess)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_server_settings(host: str, token: str | None, max_request_mb: float, token_env: str) -> None:
    if not is_loopback(host) and not token:
        raise ConfigError("--host", host, f"a server reachable from other machines needs a token: set the environment "
                                          f"variable {token_env} to a secret of at least {MIN_TOKEN_CHARS} characters, "
                                          "or listen on 127.0.0.1")
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        raise ConfigError("--token-env", token_env, f"the token in ${token_env} has {len(token)} characters; use at "
                                                    f"least {MIN_TOKEN_CHARS} (e.g. python -c 'import secrets; "
                                                    "print(secrets.token_urlsafe(24))')")
    if not max_request_mb > 0:
        raise ConfigError("--max-request-mb", max_request_mb, "a size in MB > 0")


class _CappedHTTPServer(ThreadingHTTPServer):
    """At most `max_connections` open at once: a connection past the cap is closed as soon as it
    is accepted, so idle or slow clients cannot use up the process's file descriptors (and with
    them every valid client's requests)."""

    daemon_threads = True

    def __init__(self, address, handler, max_connections: int):
        self._slots = threading.BoundedSemaphore(max_connections)
        if ":" in address[0]:  # an IPv6 literal (::1): the socket must be of that family to bind it
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._slots.release()
            raise

    def handle_error(self, request, client_address):
        import sys

        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            return  # a client that left, or one the header deadline dropped: nothing to report
        super().handle_error(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class RewardServer:
    """Serves `reward` (a registered name, built with `options`) on host:port until `close()`."""

    def __init__(self, reward: str, options: dict | None = None, host: str = "127.0.0.1", port: int = 0,
                 token: str | None = None, max_request_mb: float = 64.0, limits: Limits = Limits(),
                 read_timeout_s: float = 30.0, token_env: str = "PIXELRL_REWARD_TOKEN", max_connections: int = 64,
                 header_timeout_s: float = 10.0):
        check_server_settings(host, token, max_request_mb, token_env)
        self.name, self.limits = reward, limits
        self.max_request_bytes = int(max_request_mb * 1024 * 1024)
        self.expected_auth = f"Bearer {token}".encode() if token else None
        self.requests_scored = 0
        self._score_lock = threading.Lock()
        # the port first: a port in use is refused before a reward model spends minutes loading
        try:
            self._httpd = _CappedHTTPServer((host, port), _handler_class(self, read_timeout_s, header_timeout_s),
                                            max_connections)
        except OSError as err:
            raise ConfigError("--port", port, f"cannot listen on {host}:{port} ({err.strerror or err}): another "
                              "server holds it; pick a free port, or 0 for any") from None
        self._thread: threading.Thread | None = None
        try:
            self.reward_fn = get_reward(reward, **dict(options or {}))
        except BaseException:
            self._httpd.server_close()
            raise

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def serve_forever(self) -> None:
        self._httpd.serve_forever()

    def start(self) -> "RewardServer":
        """Serve from a background thread (tests, notebooks)."""
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="reward-server", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    def authorised(self, header: str | None) -> bool:
        if self.expected_auth is None:
            return True
        return header is not None and hmac.compare_digest(header.encode(), self.expected_auth)

    def score(self, body: bytes) -> bytes:
        # decoding holds the same lock as scoring: one request's decoded images (at most
        # limits.max_total_pixels) are in memory at a time, however many clients send at once
        with self._score_lock, torch.no_grad():
            images, prompts, metadata, sources = decode_request(body, self.limits)
            extra = {}
            if getattr(self.reward_fn, "reads_condition_images", False):
                if sources is None:
                    raise WireError(f"reward `{self.name}` reads each edit's source images and the request sent none: "
                                    "set the remote reward's option send_sources: true")
                extra["condition_images"] = [tuple(torch.from_numpy(a) for a in row) for row in sources]
            try:
                out = self.reward_fn(torch.from_numpy(images), prompts, metadata, **extra)
                scores = check_reward_output(self.name, out, len(prompts))
            except Exception as err:  # the client must see why; nothing here is retried
                raise WireError(f"reward `{self.name}` failed on this request: {type(err).__name__}: {err}",
                                status=500) from err
            self.requests_scored += 1
        return encode_scores(scores)


def _handler_class(server: RewardServer, read_timeout_s: float, header_timeout_s: float):
    class Handler(BaseHTTPRequestHandler):
        timeout = read_timeout_s  # a client that stops sending is dropped, not waited for
        protocol_version = "HTTP/1.1"

        def handle_one_request(self):
            # the request line and headers (or, between requests, the next one) within the
            # deadline, however slowly the bytes come: past it the socket is shut and the slot freed
            self._header_deadline = threading.Timer(header_timeout_s, self._drop)
            self._header_deadline.daemon = True
            self._header_deadline.start()
            try:
                super().handle_one_request()
            finally:
                self._header_deadline.cancel()

        def parse_request(self) -> bool:
            self._header_deadline.cancel()  # the headers are in; the body has its own checks
            ok = super().parse_request()
            if ok and not server.authorised(self.headers.get("Authorization")):
                self.close_connection = True  # only a client with the token may keep a connection open
            return ok

        def _drop(self) -> None:
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:  # already closed
                pass

        def log_message(self, format, *args):  # one line per failure (below), not per request
            pass

        def _answer(self, status: int, body: bytes, extra: dict | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if self.close_connection and "Connection" not in (extra or {}):
                self.send_header("Connection", "close")
            for key, value in (extra or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body)

        @property
        def shown_path(self) -> str:
            """The path without its query string, which may carry a secret (a token put in the URL)
            and is never logged or answered back."""
            route, _, query = self.path.partition("?")
            return route + ("?<query not shown>" if query else "")

        def _error(self, status: int, message: str, extra: dict | None = None) -> None:
            print(f"reward server: {status} for {self.command} {self.shown_path} from {self.client_address[0]}: "
                  f"{message}", flush=True)
            # the body was not read: the connection cannot be reused
            self.close_connection = True
            self._answer(status, json.dumps({"error": message}).encode(), {"Connection": "close", **(extra or {})})

        def do_GET(self):
            if "?" in self.path:
                return self._error(400, "query strings are not read: GET /health (a token goes in the Authorization "
                                        "header, never in the URL)")
            if self.path != "/health":
                return self._error(404, f"no {self.shown_path}; GET /health or POST /score")
            self._answer(200, json.dumps({"status": "ok", "protocol": PROTOCOL}).encode())

        def do_POST(self):
            if "?" in self.path:
                return self._error(400, "query strings are not read: POST /score with the token in the Authorization "
                                        "header, never in the URL")
            if self.path != "/score":
                return self._error(404, f"no {self.shown_path}; POST /score")
            if not server.authorised(self.headers.get("Authorization")):
                return self._error(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})
            if self.headers.get_content_type() != "application/json":
                return self._error(415, f"Content-Type {self.headers.get_content_type()} is refused; send "
                                        "application/json (never pickle)")
            if "Transfer-Encoding" in self.headers or self.headers.get("Content-Length") is None:
                return self._error(411, "send a Content-Length (chunked bodies are refused)")
            try:
                length = int(self.headers["Content-Length"])
            except ValueError:
                return self._error(400, "Content-Length is not a number")
            if length < 0 or length > server.max_request_bytes:
                return self._error(413, f"the body is {length} bytes, over this server's {server.max_request_bytes}; "
                                        "send smaller batches (the remote reward's batch_size)")
            body = self.rfile.read(length)
            if len(body) != length:
                return self._error(400, f"the body ended after {len(body)} of {length} bytes")
            try:
                answer = server.score(body)
            except WireError as err:
                return self._error(err.status, str(err))
            self._answer(200, answer)

    return Handler
