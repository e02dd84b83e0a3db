"""Launched profiles on a REAL llama-server: start, crash and restart, client disconnects, and clean exits."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes.servers import LlamaServer, ProxyProcess, http_json, llama_children, pid_alive, wait_until
from tests.support.sse import stream_events

LONG = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 20000, "ignore_eos": True, "stream": True}


def _launch(tiny_gguf: Path, state: Path, port: int | None = None, *extra: str) -> ProxyProcess:
    return ProxyProcess(
        *extra,
        "--server-per-profile",  # one process per profile: what these tests crash, restart and count
        "--model",
        str(tiny_gguf),
        "--threads",
        "1",
        "--ctx-size",
        "32768",
        env={"ADAPTIVE_SPEC_STATE_DIR": str(state)},
        port=port,
    )


def servers_using(state: Path) -> list[int]:
    """Every llama-server on the machine whose command line points into this test's state dir."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"llama-server" in cmdline and str(state).encode() in cmdline and pid_alive(int(entry.name)):
                found.append(int(entry.name))
    return found


@pytest.fixture
def launched(tiny_gguf: Path, tmp_path: Path, llama_server_binary: str) -> Iterator[ProxyProcess]:
    proxy = _launch(tiny_gguf, tmp_path)
    yield proxy
    proxy.stop()


def _open_stream(url: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    return urllib.request.urlopen(req, timeout=60)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_launched_servers_are_gone_after_exit(launched: ProxyProcess, sig: signal.Signals, tmp_path: Path) -> None:
    children = llama_children(launched)
    assert sorted(children.values()) == ["iterative", "oneshot"]
    assert "profiles:" in launched.log() and "spec-types" in launched.log()
    assert launched.send_signal(sig) == 0
    for pid in children:
        assert not pid_alive(pid), f"llama-server {pid} outlived the proxy"
    assert not list(tmp_path.glob("run-*")), "the run directory (slot files, logs) was not cleaned up"


def test_servers_die_with_a_killed_proxy(launched: ProxyProcess) -> None:
    children = llama_children(launched)
    assert len(children) == 2
    launched.proc.kill()
    launched.proc.wait()
    wait_until(lambda: not any(pid_alive(p) for p in children), 10, "llama-server children to exit")


def test_profile_killed_mid_stream(launched: ProxyProcess) -> None:
    by_name = {name: pid for pid, name in llama_children(launched).items()}
    url = launched.base + "/v1/chat/completions"
    with _open_stream(url, LONG, {"x-adaptive-spec-profile": "iterative"}) as resp:
        stream = stream_events(resp)
        assert next(stream).data.startswith("{")
        os.kill(by_name["iterative"], signal.SIGKILL)
        started = time.monotonic()
        tail = list(stream)  # must end, not hang
    assert time.monotonic() - started < 10
    assert json.loads(tail[-1].data)["error"]["code"] == "upstream_disconnected"
    # The other profile keeps serving meanwhile.
    with _open_stream(url, {**LONG, "max_tokens": 8}, {"x-adaptive-spec-profile": "oneshot"}) as resp:
        assert b'"finish_reason":"length"' in resp.read()
    # The crashed one is restarted and serves again.
    wait_until(lambda: "iterative" in llama_children(launched).values(), 30, "the iterative profile to restart")
    wait_until(
        lambda: http_json(launched.base + "/adaptive/health")["profiles"]["iterative"]["up"],
        60,
        "the restarted profile to be healthy",
    )
    with _open_stream(url, {**LONG, "max_tokens": 8}, {"x-adaptive-spec-profile": "iterative"}) as resp:
        assert b'"finish_reason":"length"' in resp.read()
    assert "restarting in" in launched.log()


def test_client_disconnect_frees_the_slot(tiny_server: LlamaServer) -> None:
    proxy = ProxyProcess("--profile", f"plain={tiny_server.url}")
    try:
        resp = _open_stream(proxy.base + "/v1/chat/completions", LONG, {})
        stream = stream_events(resp)
        for _ in range(3):
            assert next(stream).data.startswith("{")
        assert tiny_server.slot_busy(), "the request should still be generating"
        resp.close()
        wait_until(lambda: not tiny_server.slot_busy(), 3, "llama-server to free the slot")
        wait_until(lambda: proxy.requests() and proxy.requests()[-1]["status"] == 499, 3, "the request record")
    finally:
        proxy.stop()


def test_profiles_serving_different_models_are_refused(
    llama_server_binary: str, tiny_gguf: Path, tmp_path: Path, tiny_server: LlamaServer
) -> None:
    other_model = tmp_path / "another-model.gguf"
    other_model.write_bytes(tiny_gguf.read_bytes())
    other = LlamaServer(llama_server_binary, other_model, "-c", "2048", log_dir=tmp_path)
    try:
        with pytest.raises(AssertionError) as info:
            ProxyProcess("--profile", f"a={tiny_server.url}", "--profile", f"b={other.url}", ready_timeout=60)
        message = str(info.value)
        assert "profiles serve different models" in message
        assert "'a' serves 'tiny-random-llama.gguf'" in message and "'b' serves 'another-model.gguf'" in message
    finally:
        other.stop()


def test_servers_are_stopped_when_start_up_fails(tiny_gguf: Path, tmp_path: Path, llama_server_binary: str) -> None:
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("")
    with pytest.raises(AssertionError) as info:  # the trace file is opened once the profiles are up
        _launch(tiny_gguf, tmp_path, None, "--trace", str(not_a_folder / "trace.jsonl"))
    assert "ready at" in str(info.value), "the profiles should have started before the trace failed"
    assert f"error: --trace {not_a_folder / 'trace.jsonl'}: " in str(info.value)
    assert servers_using(tmp_path) == []


def test_launched_profiles_trace_with_their_spec_types(
    tiny_gguf: Path, tmp_path: Path, llama_server_binary: str
) -> None:
    import orjson

    trace = tmp_path / "trace.jsonl"
    proxy = _launch(tiny_gguf, tmp_path, None, "--trace", str(trace))
    try:
        with _open_stream(proxy.base + "/v1/chat/completions", {**LONG, "max_tokens": 4}, {}) as resp:
            resp.read()
    finally:
        proxy.stop()
    lines = [orjson.loads(line) for line in trace.read_text().splitlines()]
    assert {p["name"]: p["spec_types"] for p in lines[0]["profiles"]} == {
        "oneshot": ["none"],
        "iterative": ["ngram-mod"],
    }
    assert lines[-1]["kind"] == "request" and lines[-1]["profile"] == "oneshot"
