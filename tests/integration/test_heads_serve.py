"""Warm starts through `adaptive-spec serve` as a user runs it (tiny model): a restarted `serve`, with a fresh
llama-server, finds the heads the last run left in the state directory and starts warm; `--no-heads` keeps none."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support.servers import ProxyProcess, chat_record, http_json

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


def test_a_restarted_serve_starts_warm_from_the_heads_it_left(tiny_gguf: Path, tmp_path: Path) -> None:
    proxy = _serve(tiny_gguf, tmp_path)
    try:
        cold = chat_record(proxy, MESSAGES, 4, **{"x-session-id": "before"})
        assert cold["timings"]["cache_n"] < 10
        head = _heads(proxy, 1)[0]
        assert any(line.startswith("heads: ") for line in proxy.stdout_lines + proxy.stderr_lines), proxy.log()
    finally:
        proxy.stop()
    assert list((tmp_path / "state").glob("run-*")) == []  # the run folder went; the heads stayed
    assert len(list((tmp_path / "state" / "heads").glob("*.head"))) == 1
    proxy = _serve(tiny_gguf, tmp_path)
    try:
        warm = chat_record(proxy, MESSAGES, 4, **{"x-session-id": "after"})
        assert "warm: head of" in warm["reason"], warm
        assert warm["timings"]["cache_n"] >= int(str(head["tokens"])) - 1, warm
        assert warm["text"] == cold["text"]
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
