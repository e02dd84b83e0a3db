"""Access checks: keys, Host names, origins, control endpoints, router-mode model pinning."""

from __future__ import annotations

import orjson
import pytest

from adaptive_spec.access.rules import (
    AccessPolicy,
    control_refusal,
    host_allowed,
    hosts_for_bind,
    is_loopback,
    key_accepted,
    origin_allowed,
    sent_keys,
    with_model,
)


def test_keys_come_from_bearer_or_x_api_key() -> None:
    assert sent_keys("Bearer abc", None) == ["abc"]
    assert sent_keys("bearer  abc ", "def") == ["abc", "def"]
    assert sent_keys("Basic abc", None) == []
    policy = AccessPolicy(api_keys=("k1", "k2"))
    assert key_accepted(policy, ["nope", "k2"])
    assert not key_accepted(policy, ["k"])
    assert not key_accepted(policy, [])
    assert not key_accepted(AccessPolicy(), ["k1"])


@pytest.mark.parametrize(
    ("host", "ok"),
    [
        ("127.0.0.1:8088", True),
        ("localhost", True),
        ("LOCALHOST.:1", True),
        ("[::1]:8088", True),
        (None, True),
        ("attacker.example", False),
        ("attacker.example:8088", False),
        ("127.0.0.1@evil", False),
        ("", False),
        ("localhost.attacker.example", False),
        ("[::ffff:7f00:1]", False),
        ("127.0.0.1 x", False),
    ],
)
def test_host_allow_list(host: str | None, ok: bool) -> None:
    assert host_allowed(AccessPolicy(), host) is ok


def test_hosts_for_bind_and_ports() -> None:
    assert hosts_for_bind("0.0.0.0") == ("localhost", "127.0.0.1", "[::1]")
    assert hosts_for_bind("192.168.1.5", ("box.lan:8088",))[-2:] == ("192.168.1.5", "box.lan:8088")
    assert hosts_for_bind("::1") == ("localhost", "127.0.0.1", "[::1]")
    policy = AccessPolicy(allowed_hosts=hosts_for_bind("0.0.0.0", ("box.lan:8088",)))
    assert host_allowed(policy, "box.lan:8088") and not host_allowed(policy, "box.lan:9000")
    assert host_allowed(AccessPolicy(allowed_hosts=("*",)), "anything")
    assert is_loopback("127.0.0.2") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.5") and not is_loopback("box.lan")


def test_origins() -> None:
    policy = AccessPolicy(cors_origins=("https://app.example",))
    assert origin_allowed(policy, None, "127.0.0.1:8088")
    assert origin_allowed(policy, "http://127.0.0.1:8088", "127.0.0.1:8088")  # the proxy's own page
    assert origin_allowed(policy, "https://app.example/", "127.0.0.1:8088")
    assert not origin_allowed(policy, "http://localhost:3000", "127.0.0.1:8088")
    assert not origin_allowed(policy, "null", "127.0.0.1:8088")
    assert not origin_allowed(AccessPolicy(), "http://127.0.0.1:8089", "127.0.0.1:8088")


@pytest.mark.parametrize(
    ("method", "path", "query", "refused"),
    [
        ("POST", "/slots/0", {"action": "erase"}, True),
        ("GET", "/slots", {}, False),
        ("GET", "/slots/0", {"action": "save"}, True),
        ("POST", "/models/load", {}, True),
        ("POST", "/props", {}, True),
        ("GET", "/props", {}, False),
        ("POST", "/lora-adapters", {}, True),
        ("POST", "/tokenize", {}, False),
        ("DELETE", "/models", {}, True),
        ("GET", "/models", {}, False),
        ("GET", "/cors-proxy", {"url": "http://x"}, True),
        ("POST", "/tools", {}, True),
    ],
)
def test_control_endpoints(method: str, path: str, query: dict[str, str], refused: bool) -> None:
    assert (control_refusal(AccessPolicy(), method, path, query) is not None) is refused
    assert control_refusal(AccessPolicy(allow_profile_control=True), method, path, query) is None


def test_router_preset_is_pinned_in_bodies() -> None:
    assert orjson.loads(with_model(b'{"model": "other", "content": "x"}', "plain"))["model"] == "plain"
    assert orjson.loads(with_model(b'{"content": "x"}', "plain"))["model"] == "plain"
    assert with_model(b"not json", "plain") == b"not json"
    assert with_model(b"[1]", "plain") == b"[1]"
