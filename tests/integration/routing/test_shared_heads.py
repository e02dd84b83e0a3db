"""Two `serve` processes sharing one real redis-server (`--shared-state`) and one real llama-server (the tiny
random-weight model), each with its own state directory on one host: a head saved through one proxy is restored
through the other for a new session (its record says so, and llama-server's `cache_n` shows it); a head deleted
through one is gone from the other; slots erased through one are not counted on by the other. And Redis on a host of
its own (a network namespace, `tests/support/processes/hosts.py`), the proxies on another."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes.hosts import Hosts
from tests.support.processes.redis import RedisServer
from tests.support.processes.servers import LlamaServer, ProxyProcess, chat_record, http_json, wait_until
from tests.support.shared_proxies import MESSAGES, heads_listed, one_slot_server, proxies


@pytest.fixture
def server(llama_server_binary: str, tiny_gguf: Path, tmp_path: Path) -> Iterator[tuple[LlamaServer, Path]]:
    started = one_slot_server(llama_server_binary, tiny_gguf, tmp_path)
    yield started, tmp_path / "slots"
    started.stop()


def _proxies(server: tuple[LlamaServer, Path], home: Path, *extra: str) -> list[ProxyProcess]:
    return proxies(server[0].url, server[1], home, *extra)


def _erase_directly(server: LlamaServer) -> None:
    """The slot emptied behind both proxies' backs: what a session then reuses, a restore put there."""
    http_json(f"{server.url}/slots/0?action=erase", {})


def test_a_head_saved_through_one_proxy_is_restored_through_the_other(
    server: tuple[LlamaServer, Path], redis_server: RedisServer, tmp_path: Path
) -> None:
    a, b = _proxies(server, tmp_path, "--shared-state", redis_server.url)
    try:
        cold = chat_record(a, MESSAGES, 4, **{"x-session-id": "first"})
        (saved,) = heads_listed(a, 1)
        (taken,) = heads_listed(b, 1)  # told through Redis, taken from a's folder, its checksum checked
        assert taken["id"] == saved["id"] and taken["bytes"] == saved["bytes"]
        _erase_directly(server[0])
        warm = chat_record(b, MESSAGES, 4, **{"x-session-id": "second"})
        assert "warm: head of" in warm["reason"], (warm["reason"], b.log())
        assert warm["timings"]["cache_n"] >= int(saved["tokens"]) - 1, warm["timings"]
        assert warm["text"] == cold["text"]
        # Deleted through a: gone from b too.
        req = urllib.request.Request(f"{a.base}/adaptive/heads/{saved['id']}", method="DELETE")
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200
        heads_listed(b, 0)
    finally:
        for proxy in (a, b):
            proxy.stop()


def test_without_the_shared_state_the_other_proxy_prefills(server: tuple[LlamaServer, Path], tmp_path: Path) -> None:
    """The same through two proxies that share nothing: the other proxy has no head to restore (the test above can
    fail)."""
    a, b = _proxies(server, tmp_path)
    try:
        chat_record(a, MESSAGES, 4, **{"x-session-id": "first"})
        heads_listed(a, 1)
        _erase_directly(server[0])
        cold = chat_record(b, MESSAGES, 4, **{"x-session-id": "second"})
        assert "warm: head of" not in cold["reason"] and cold["timings"]["cache_n"] < 10, cold
        assert http_json(b.base + "/adaptive/heads")["heads"] == []
    finally:
        for proxy in (a, b):
            proxy.stop()


def _in_slot(proxy: ProxyProcess, session: str) -> bool:
    placements = http_json(proxy.base + "/adaptive/route")["placements"]
    return bool(next(p for p in placements if p["session_id"] == session)["in_slot"])


def test_slots_erased_through_one_proxy_are_not_counted_on_by_the_other(
    server: tuple[LlamaServer, Path], redis_server: RedisServer, tmp_path: Path
) -> None:
    a, b = _proxies(server, tmp_path, "--shared-state", redis_server.url, "--no-heads")
    try:
        chat_record(b, MESSAGES, 4, **{"x-session-id": "kept"})
        assert _in_slot(b, "kept")
        http_json(a.base + "/adaptive/profiles/plain/erase", {})
        wait_until(lambda: not _in_slot(b, "kept"), 10, "b to hear that a erased the slots")
    finally:
        for proxy in (a, b):
            proxy.stop()


def test_redis_on_a_host_of_its_own_and_its_link_down_meanwhile(
    llama_server_binary: str, tiny_gguf: Path, tmp_path: Path
) -> None:
    """Redis in a network namespace of its own, the proxies (and their llama-server) in another: every call to Redis
    crosses a veth. The head goes from one proxy to the other through it; with Redis's link down the proxies serve on
    from their own state (and say so), and share again once it is back."""
    hosts = Hosts(["redis", "proxies"])
    started: list[Any] = []
    try:
        (tmp_path / "redis").mkdir()
        redis_host, here = hosts.address("redis"), hosts.address("proxies")
        # A password: a Redis beyond loopback takes none without one (protected mode), as a real deployment.
        redis_server = RedisServer(tmp_path / "redis", "hosts-redis-pass", host=redis_host, wrap=hosts.run("redis"))
        started.append(redis_server)
        slots = tmp_path / "slots"
        slots.mkdir()
        args = ("-c", "8192", "--parallel", "1", "--spec-type", "none", "--slot-save-path", str(slots))
        server = LlamaServer(
            llama_server_binary, tiny_gguf, *args, log_dir=tmp_path, host=here, wrap=hosts.run("proxies")
        )
        started.append(server)
        a, b = (
            ProxyProcess(
                *("--profile", f"plain={server.url}", "--slot-dir", str(slots), "--shared-state", redis_server.url),
                *("--host", here, "--insecure-no-key"),  # the switch is the test's own: only this process reaches it
                env={"ADAPTIVE_SPEC_STATE_DIR": str(tmp_path / n), "ADAPTIVE_SPEC_CONFIG_DIR": str(tmp_path / n)},
                host=here,
                wrap=hosts.run("proxies"),
            )
            for n in ("a", "b")
        )
        started += [a, b]
        cold = chat_record(a, MESSAGES, 4, **{"x-session-id": "first"})
        (saved,) = heads_listed(a, 1)
        heads_listed(b, 1)
        http_json(f"{server.url}/slots/0?action=erase", {})
        warm = chat_record(b, MESSAGES, 4, **{"x-session-id": "second"})
        assert "warm: head of" in warm["reason"] and warm["text"] == cold["text"], warm["reason"]
        assert warm["timings"]["cache_n"] >= int(saved["tokens"]) - 1
        hosts.link_down("redis")
        out = chat_record(b, [{"role": "user", "content": "while Redis is away"}], 2, **{"x-session-id": "third"})
        assert out["status"] == 200
        assert http_json(b.base + "/adaptive/health")["shared_state"]["reachable"] is False
        hosts.link_up("redis")

        def shared_again() -> bool:
            chat_record(b, [{"role": "user", "content": "and back"}], 2, **{"x-session-id": "fourth"})
            return bool(http_json(b.base + "/adaptive/health")["shared_state"]["reachable"])

        wait_until(shared_again, 30, "b to reach Redis again", interval=1.2)
    finally:
        for process in reversed(started):
            process.stop()
        hosts.close()
    assert hosts.left() == []


def test_a_turn_whose_slot_another_proxy_used_before_its_save_is_not_saved(
    server: tuple[LlamaServer, Path], redis_server: RedisServer, tmp_path: Path
) -> None:
    """One slot, two proxies: a serves a session's turn (its state saved once the session has been idle a while, by
    the policy's `session_idle_s`), and meanwhile b forwards another client's prompt of the same length into that
    slot. When a's save runs the slot
    holds b's KV: a's save guard counts b's request through the shared forward counts (its own proxy's counts never
    saw it) and saves nothing."""
    policy = tmp_path / "policy.toml"
    policy.write_text("[heads]\nsession_idle_s = 3\n")
    a, b = _proxies(server, tmp_path, "--shared-state", redis_server.url, "--policy", str(policy))
    try:
        # The session's first request a sees, resumed with a reply in it: a session's state, saved when it is idle.
        resumed = [*MESSAGES, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Add a test."}]
        turn = chat_record(a, resumed, 4, **{"x-session-id": "conv"})
        assert http_json(a.base + "/adaptive/heads")["idle_waits"] == 1, a.log()
        # Another client's conversation of the same length (its slot file passes the save's token checks).
        theirs = [{"role": m["role"], "content": m["content"].replace("never edit", "never open")} for m in resumed]
        other = chat_record(b, theirs, 4, **{"x-session-id": "other"})
        assert turn["status"] == other["status"] == 200

        def decided() -> bool:  # a's idle wait ended, and its save was tried (or dropped) and is over
            seen = http_json(a.base + "/adaptive/heads")
            return bool(seen["idle_waits"] == 0 and seen["pending"] == 0)

        wait_until(decided, 60, "a's idle wait to end")
        seen = http_json(a.base + "/adaptive/heads")
        assert seen["counts"]["session_saved"] == 0 and seen["counts"]["dropped"] == 1, (seen, a.log())
        assert seen["heads"] == [], seen  # no file holds b's KV under a's session
        # A request b forwards without a route (it books no slot) may use any slot: counted all the same; a GET
        # (/props, /slots) uses none and is not.
        (key,) = redis_server.client().keys("adaptive-spec:forwards:*")
        before = redis_server.client().hgetall(key)
        http_json(b.base + "/tokenize", {"content": "hi"})
        http_json(b.base + "/props")
        after = redis_server.client().hgetall(key)
        assert int(after[b"all"]) == int(before[b"all"]) + 1, (before, after)
        assert int(after[b"unnamed"]) == int(before.get(b"unnamed", b"0")) + 1, (before, after)
    finally:
        for proxy in (a, b):
            proxy.stop()


def test_with_the_shared_state_unreachable_no_turn_is_saved(
    server: tuple[LlamaServer, Path], redis_server: RedisServer, tmp_path: Path
) -> None:
    """Redis stopped: the other proxies' requests cannot be counted, so the guard cannot tell what the slot holds
    when the save runs; nothing is saved, and /adaptive/health says so."""
    policy = tmp_path / "policy.toml"
    policy.write_text("[heads]\nsession_idle_s = 1\n")
    a, b = _proxies(server, tmp_path, "--shared-state", redis_server.url, "--policy", str(policy))
    try:
        redis_server.stop()
        resumed = [*MESSAGES, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Add a test."}]
        assert chat_record(a, resumed, 4, **{"x-session-id": "conv"})["status"] == 200

        def decided() -> bool:
            seen = http_json(a.base + "/adaptive/heads")
            return bool(seen["idle_waits"] == 0 and seen["pending"] == 0)

        wait_until(decided, 60, "a's idle wait to end")
        seen = http_json(a.base + "/adaptive/heads")
        assert seen["counts"]["session_saved"] == 0 and seen["counts"]["dropped"] == 1, (seen, a.log())
        health = http_json(a.base + "/adaptive/health")["shared_state"]
        assert health["reachable"] is False and any("no head is saved" in w for w in health["weakened"]), health
    finally:
        for proxy in (a, b):
            proxy.stop()
