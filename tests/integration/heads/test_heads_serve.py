"""Warm starts through `adaptive-spec serve` as a user runs it (tiny model): a restarted `serve`, with a fresh
llama-server, finds the heads the last run left in the state directory and restores them into the idle slot while it
waits for requests (the start-up line says so); a llama-server killed and restarted by `serve` gets them back the
same way; a `serve` killed while it keeps a head leaves a store the next run repairs; `--no-heads` keeps none."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from tests.support.processes.servers import ProxyProcess, chat_record, http_json, llama_children, pid_alive, wait_until

SYSTEM = "You are a coding agent. Rules:\n" + "\n".join(
    f"{i}. Keep function_{i} small, typed and tested; never edit file_{i}.py without reading it." for i in range(40)
)
MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Write hello.py."}]


def _serve(tiny_gguf: Path, home: Path, *extra: str) -> ProxyProcess:
    env = {"ADAPTIVE_SPEC_STATE_DIR": str(home / "state"), "ADAPTIVE_SPEC_CONFIG_DIR": str(home / "config")}
    args = ("--model", str(tiny_gguf), "--threads", "1", "--ctx-size", "8192", "--parallel", "1", *extra)
    return ProxyProcess(*args, env=env)


def _heads(proxy: ProxyProcess, count: int) -> list[dict[str, object]]:
    deadline = time.monotonic() + 60
    while len(heads := http_json(proxy.base + "/adaptive/heads")["heads"]) < count:
        assert time.monotonic() < deadline, proxy.log()
        time.sleep(0.1)
    return list(heads)


def _warm_line(proxy: ProxyProcess, when: str) -> str:
    """The line saying what a warm start restored (it runs in the background: wait for it)."""
    found: list[str] = []

    def said() -> bool:
        found[:] = [line for line in proxy.stderr_lines + proxy.stdout_lines if f"slots {when}" in line]
        return bool(found)

    wait_until(said, 60, f"the warm start {when}")
    return found[0]


def test_a_restarted_serve_starts_warm_from_the_heads_it_left(tiny_gguf: Path, tmp_path: Path) -> None:
    proxy = _serve(tiny_gguf, tmp_path)
    try:
        cold = chat_record(proxy, MESSAGES, 4, **{"x-session-id": "before"})
        assert cold["timings"]["cache_n"] < 10
        head = _heads(proxy, 1)[0]
        assert any("restored into a fresh server's idle slots" in line for line in proxy.stderr_lines), proxy.log()
    finally:
        proxy.stop()
    assert list((tmp_path / "state").glob("run-*")) == []  # the run folder went; the heads stayed
    assert len(list((tmp_path / "state" / "heads").glob("*.head"))) == 1
    proxy = _serve(tiny_gguf, tmp_path)
    try:
        assert "heads: 1 of 1 heads restored into" in _warm_line(proxy, "at start"), proxy.log()
        warm = chat_record(proxy, MESSAGES, 4, **{"x-session-id": "after"})
        assert "warm: head of" in warm["reason"] and "when the server started" in warm["reason"], warm
        assert warm["timings"]["cache_n"] >= int(str(head["tokens"])) - 1, warm
        assert warm["text"] == cold["text"]
    finally:
        proxy.stop()


def test_a_llama_server_killed_and_restarted_by_serve_gets_its_heads_back(tiny_gguf: Path, tmp_path: Path) -> None:
    proxy = _serve(tiny_gguf, tmp_path)
    try:
        cold = chat_record(proxy, MESSAGES, 4, **{"x-session-id": "before"})
        head = _heads(proxy, 1)[0]
        (pid,) = llama_children(proxy)
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: llama_children(proxy) and pid not in llama_children(proxy), 60, "a new llama-server")
        assert "heads: 1 of 1 heads restored into" in _warm_line(proxy, "after a restart"), proxy.log()
        warm = chat_record(proxy, MESSAGES, 4, **{"x-session-id": "after-crash"})
        assert "warm: head of" in warm["reason"], warm
        assert warm["timings"]["cache_n"] >= int(str(head["tokens"])) - 1, warm
        assert warm["text"] == cold["text"]
    finally:
        proxy.stop()


def test_a_serve_killed_while_it_keeps_heads_leaves_a_store_the_next_run_repairs(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    proxy = _serve(tiny_gguf, tmp_path)
    children: list[int] = []
    try:
        for i in range(3):  # three heads, the last one killed in its save (or just after it)
            system = SYSTEM.replace("Rules:", f"Rules of team {i}:")
            chat_record(proxy, [{"role": "system", "content": system}, MESSAGES[1]], 2, **{"x-session-id": f"k{i}"})
        children = list(llama_children(proxy))
        proxy.proc.send_signal(signal.SIGKILL)
        proxy.proc.wait(30)
    finally:
        for pid in children:  # a killed serve cannot stop its llama-server: the test does
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
    heads_dir = tmp_path / "state" / "heads"
    (heads_dir / "0123456789abcdef01234567.head").write_bytes(b"half a save")  # as a kill mid-copy leaves
    (heads_dir / ".index.json.tmp").write_text('[{"id": "')
    proxy = _serve(tiny_gguf, tmp_path)
    try:
        listed = http_json(proxy.base + "/adaptive/heads")
        kept = {str(h["id"]): int(str(h["bytes"])) for h in listed["heads"]}
        on_disk = {p.stem: p.stat().st_size for p in heads_dir.glob("*.head")}
        assert kept == on_disk and listed["bytes"] <= listed["max_bytes"], (kept, on_disk)
        assert not (heads_dir / ".index.json.tmp").exists()
        served = chat_record(proxy, MESSAGES, 2, **{"x-session-id": "after-kill"})
        assert served["status"] == 200 and "Traceback" not in proxy.log()
    finally:
        proxy.stop()


@pytest.mark.parametrize("flag", ["--no-heads"])
def test_no_heads_keeps_none(tiny_gguf: Path, tmp_path: Path, flag: str) -> None:
    proxy = _serve(tiny_gguf, tmp_path, flag)
    try:
        chat_record(proxy, MESSAGES, 4, **{"x-session-id": "s"})
        assert http_json(proxy.base + "/adaptive/heads") == {"enabled": False, "heads": []}
    finally:
        proxy.stop()
    assert not (tmp_path / "state" / "heads").exists()
