"""`serve-reward` on a port another server holds: one error naming --port, before the reward is
built (a reward model may take minutes to load), and a failed build leaves the port free."""

import socket

import pytest

from pixelrl.core.errors import ConfigError


def test_a_port_in_use_is_refused_before_the_reward_is_built(monkeypatch):
    from pixelrl.rewards import server

    built = []
    monkeypatch.setattr(server, "get_reward", lambda name, **options: built.append(name) or (lambda *a: {}))
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        with pytest.raises(ConfigError, match=rf"`--port` = {port}: cannot listen on 127.0.0.1:{port}"):
            server.RewardServer("jpeg_compressibility", port=port)
        assert built == []  # refused before the reward was built
    finally:
        holder.close()


def test_a_reward_that_fails_to_build_leaves_the_port_free(monkeypatch):
    from pixelrl.rewards import server

    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()

    def broken(name, **options):
        raise ValueError("no such model folder")

    monkeypatch.setattr(server, "get_reward", broken)
    with pytest.raises(ValueError, match="no such model folder"):
        server.RewardServer("jpeg_compressibility", port=port)
    monkeypatch.undo()
    with server.RewardServer("jpeg_compressibility", port=port) as again:  # the port was released
        assert again.url.endswith(f":{port}")


def test_the_ipv6_loopback_is_served():
    """--host ::1 was refused with a message blaming another server: the server bound IPv4 only."""
    import json
    import urllib.request

    from pixelrl.rewards import server

    if not socket.has_ipv6:
        pytest.skip("this Python has no IPv6 sockets")
    try:
        probe = socket.socket(socket.AF_INET6)
        probe.bind(("::1", 0))
        probe.close()
    except OSError as err:
        pytest.skip(f"this machine has no IPv6 loopback ({err})")
    with server.RewardServer("jpeg_compressibility", host="::1") as served:
        assert served.url.startswith("http://[::1]:")
        with urllib.request.urlopen(served.url + "/health", timeout=10) as answer:
            assert json.loads(answer.read())["status"] == "ok"
