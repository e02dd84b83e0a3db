"""Two `serve` processes sharing one real redis-server (`--shared-state`) and one real llama-server (the tiny
random-weight model, one slot): the server restarted (stopped, started again on its port) under a conversation one
proxy served is not counted on by the other, which finds it only through the shared state; one proxy alone
warm-starts it, not both; a restore one proxy finds inert is not tried there by the other."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes.redis import RedisServer
from tests.support.processes.servers import (
    ProxyProcess,
    body_record,
    chat_record,
    http_json,
    llama_children,
    wait_until,
)
from tests.support.shared_proxies import MESSAGES, heads_listed, one_slot_server, proxies


class Restartable:
    """The server, stopped and started again on its port at will (as a supervisor that is not `serve` does)."""

    def __init__(self, binary: str, model: Path, work: Path) -> None:
        self.binary, self.model, self.work = binary, model, work
        self.now = one_slot_server(binary, model, work)
        self.url = self.now.url

    def stop(self) -> None:
        self.now.stop()

    def start(self) -> None:
        self.now = one_slot_server(self.binary, self.model, self.work, port=self.now.port)


@pytest.fixture
def server(llama_server_binary: str, tiny_gguf: Path, tmp_path: Path) -> Iterator[Restartable]:
    started = Restartable(llama_server_binary, tiny_gguf, tmp_path)
    yield started
    started.stop()


def _up(proxy: ProxyProcess) -> bool:
    (profile,) = http_json(proxy.base + "/adaptive/profiles")["profiles"]
    return bool(profile["up"])


def _restart(server: Restartable, watching: list[ProxyProcess]) -> None:
    """The server stopped until every proxy `watching` finds it down, then started again on its port."""
    server.stop()
    for proxy in watching:
        wait_until(lambda p=proxy: not _up(p), 30, "the proxy to find the server down")
    server.start()
    for proxy in watching:
        wait_until(lambda p=proxy: _up(p), 30, "the proxy to find the server back")


def _counts(proxy: ProxyProcess) -> dict[str, int]:
    return dict(http_json(proxy.base + "/adaptive/heads")["counts"])


def _erase_directly(server: Restartable) -> None:
    http_json(f"{server.url}/slots/0?action=erase", {})


def _in_slot(proxy: ProxyProcess, session: str) -> bool:
    placements = http_json(proxy.base + "/adaptive/route")["placements"]
    return bool(next(p for p in placements if p["session_id"] == session)["in_slot"])


def _turn(messages: list[dict[str, str]], reply: dict[str, Any], ask: str) -> list[dict[str, str]]:
    return [*messages, {"role": "assistant", "content": str(reply["text"])}, {"role": "user", "content": ask}]


@pytest.mark.parametrize("heads", [True, False], ids=["heads", "no-heads"])
def test_a_conversation_served_before_a_restart_is_not_counted_on_by_the_other_proxy(
    server: Restartable, redis_server: RedisServer, tmp_path: Path, heads: bool
) -> None:
    """A conversation's first turn through a, its second through b; then the server restarts while b is paused (a
    proxy that was busy, or whose health checks missed it): b learns it through the shared state alone, from a,
    which found the server fresh (and, with head stores, warmed its slot with the conversation's head)."""
    extra = () if heads else ("--no-heads",)
    a, b = proxies(server.url, tmp_path / "slots", tmp_path, "--shared-state", redis_server.url, *extra)
    try:
        first = chat_record(a, MESSAGES, 4, **{"x-session-id": "conv"})
        head_tokens = int(heads_listed(b, 1)[0]["tokens"]) if heads else 0
        two = _turn(MESSAGES, first, "And a test?")
        second = chat_record(b, two, 4, **{"x-session-id": "conv"})
        assert _in_slot(b, "conv"), second  # b counts on the slot's KV from now on
        b.proc.send_signal(signal.SIGSTOP)
        try:
            _restart(server, [a])
            if heads:
                wait_until(lambda: _counts(a)["warm_started"] == 1, 30, "a to warm the restarted server")
            else:
                wait_until(lambda: not _in_slot(a, "conv"), 30, "a to find the server fresh")
        finally:
            b.proc.send_signal(signal.SIGCONT)
        wait_until(lambda: not _in_slot(b, "conv"), 10, "b to hear that the server restarted")
        third = chat_record(b, _turn(two, second, "Run it."), 4, **{"x-session-id": "conv"})
        timings = third["timings"]
        assert third["status"] == 200, third
        if heads:
            # The slot holds a's warm head, not the conversation: b counted on none of the conversation's KV there
            # and restored the head it opens with (the slot's occupant unknown to it), all llama-server reused.
            assert "warm: head of" in third["reason"], (third["reason"], b.log())
            assert timings["cache_n"] <= head_tokens + 1 < timings["cache_n"] + timings["prompt_n"], timings
        else:
            # The slot holds nothing: llama-server prefilled the whole prompt, and b's estimate said so.
            assert timings["cache_n"] < 10, timings
            assert third["new_tokens_est"] >= timings["prompt_n"] * 0.9, (third["new_tokens_est"], timings)
    finally:
        for proxy in (a, b):
            proxy.stop()


def test_one_proxy_warms_a_restarted_server_not_both(
    server: Restartable, redis_server: RedisServer, tmp_path: Path
) -> None:
    """Both proxies find the restarted server fresh and hold the same head: one restores it into the idle slot,
    the other leaves it to it (and prefills or restores for its own requests as a slot it knows nothing of)."""
    a, b = proxies(server.url, tmp_path / "slots", tmp_path, "--shared-state", redis_server.url)
    try:
        chat_record(a, MESSAGES, 4, **{"x-session-id": "first"})
        heads_listed(b, 1)
        _restart(server, [a, b])
        both = (a, b)
        wait_until(lambda: sum(_counts(p)["warm_started"] + _counts(p)["warm_left"] for p in both) == 2, 30, "warms")
        started = [_counts(p)["warm_started"] for p in both]
        assert sorted(started) == [0, 1], ([_counts(p) for p in both], a.log(), b.log())
        other = both[started.index(0)]
        assert _counts(other)["warm_left"] == 1 and "another proxy warm-starts" in other.log()
        again = chat_record(other, MESSAGES, 4, **{"x-session-id": "second"})
        assert again["status"] == 200 and again["timings"]["prompt_n"] < 10, again["timings"]
    finally:
        for proxy in (a, b):
            proxy.stop()


def test_a_restore_one_proxy_found_inert_is_not_tried_by_the_other(
    server: Restartable, redis_server: RedisServer, tmp_path: Path
) -> None:
    a, b = proxies(server.url, tmp_path / "slots", tmp_path, "--shared-state", redis_server.url)
    try:
        chat_record(a, MESSAGES, 4, **{"x-session-id": "first"})
        heads_listed(a, 1)
        heads_listed(b, 1)
        http_json(a.base + "/adaptive/profiles/plain/erase", {})  # a knows the head is not held in the slot any more
        # The head restored for a new session whose request then reuses nothing of it: llama-server is asked not to
        # reuse a slot's cache (`cache_prompt` false), as a server that loses what it restored (llama.cpp #26676).
        body = {"model": "m", "messages": MESSAGES, "temperature": 0, "max_tokens": 4, "cache_prompt": False}
        unused = body_record(a, body, {"x-session-id": "second"})
        assert "warm: head of" in unused["reason"] and unused["timings"]["cache_n"] < 10, unused
        wait_until(lambda: _counts(a).get("inert") == 1, 10, "a's verdict")
        wait_until(lambda: _counts(b).get("inert_heard") == 1, 10, "b to hear a's verdict")
        _erase_directly(server)
        after = chat_record(b, MESSAGES, 4, **{"x-session-id": "third"})
        assert "warm: head of" not in after["reason"], (after["reason"], b.log())
        assert after["timings"]["cache_n"] < 10, after["timings"]
        assert _counts(b)["restored"] == 0
    finally:
        for proxy in (a, b):
            proxy.stop()


def test_a_server_one_proxy_launched_is_recorded_as_its_to_warm(
    tiny_gguf: Path, redis_server: RedisServer, tmp_path: Path
) -> None:
    """a launches the server (`serve --model`) and records it in Redis as its to warm while it runs; b attaches to
    it. Killed, the server is started again by a, which warms it; b warms nothing (it keys the heads of a server it
    attached by what the server reports, a those of its own by the binary it launched: b has none of that key)."""
    env = {"ADAPTIVE_SPEC_STATE_DIR": str(tmp_path / "a"), "ADAPTIVE_SPEC_CONFIG_DIR": str(tmp_path / "a")}
    launch = ("--model", str(tiny_gguf), "--threads", "1", "--ctx-size", "8192", "--parallel", "1")
    a = ProxyProcess(*launch, "--shared-state", redis_server.url, env=env)
    started = [a]
    try:
        children = llama_children(a)
        (slots,) = {_slot_dir(pid) for pid in children}
        profiles = http_json(a.base + "/adaptive/profiles")["profiles"]
        urls = {p["name"]: p["base_url"] for p in profiles}
        attach = [arg for name, url in urls.items() for arg in ("--profile", f"{name}={url}")]
        (b,) = proxies("", slots, tmp_path, "--shared-state", redis_server.url, names=("b",), profiles=attach)
        started.append(b)
        launcher = http_json(a.base + "/adaptive/health")["shared_state"]["proxy"]
        keys = [f"adaptive-spec:launched:{url}" for url in sorted(set(urls.values()))]
        assert redis_server.client().mget(keys) == [launcher.encode()] * len(keys)
        chat_record(a, MESSAGES, 4, **{"x-session-id": "first"})
        heads_listed(b, 1)
        a.proc.send_signal(signal.SIGSTOP)  # a starts it again only once b has found it down
        try:
            for pid in children:
                os.kill(pid, signal.SIGKILL)
            wait_until(lambda: not any(_up_all(b)), 30, "b to find the server down")
        finally:
            a.proc.send_signal(signal.SIGCONT)
        wait_until(lambda: all(_up_all(b)) and all(_up_all(a)), 60, "a to start it again, b to find it back")
        wait_until(lambda: _counts(a)["warm_started"] == 1, 30, "a to warm it")
        wait_until(lambda: "its slots after a restart stay empty" in b.log(), 30, "b's warm start to end")
        assert _counts(b)["warm_started"] == 0, (_counts(b), b.log())
    finally:
        for proxy in reversed(started):
            proxy.stop()
    assert redis_server.client().mget(keys) == [None] * len(keys)  # a stopped: its server is anyone's to warm


def _up_all(proxy: ProxyProcess) -> list[bool]:
    return [bool(p["up"]) for p in http_json(proxy.base + "/adaptive/profiles")["profiles"]]


def _slot_dir(pid: int) -> Path:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return Path(argv[argv.index("--slot-save-path") + 1])
