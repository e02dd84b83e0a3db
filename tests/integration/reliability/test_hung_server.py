"""A hung llama-server is found in seconds, on a REAL one (the tiny random-weight model): SIGSTOPped, its process is
alive and its socket accepts, but nothing answers. The health poll marks its profiles down within a bound,
/adaptive/profiles and /metrics say so, a request for it is refused at once with an OpenAI-shaped 503 (not after the
10-minute read timeout), and when it is SIGCONTed it is marked up again and serves. Once for a profile of its own, once
for two profiles that are per-request settings of the one server."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes.servers import LlamaServer, ProxyProcess, http_json, http_text, wait_until

DOWN_WITHIN_S = 20.0  # the poll's own bound is 2 x (POLL_S + TIMEOUT_S) = 10 s
REFUSED_WITHIN_S = 5.0
BACK_WITHIN_S = 15.0
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


def _chat(proxy: ProxyProcess, **headers: str) -> tuple[int, dict[str, Any], float]:
    """Status, body and seconds of one chat request through the proxy."""
    req = urllib.request.Request(
        proxy.base + "/v1/chat/completions",
        data=json.dumps(CHAT).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    started = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read()), time.monotonic() - started
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), time.monotonic() - started


def _profiles(proxy: ProxyProcess) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in http_json(proxy.base + "/adaptive/profiles", timeout=5)["profiles"]}


def _all(proxy: ProxyProcess, names: list[str], up: bool) -> bool:
    profiles = _profiles(proxy)
    return all(profiles[n]["up"] is up and profiles[n]["replicas"][0]["up"] is up for n in names)


@contextmanager
def _stopped(server: LlamaServer) -> Iterator[float]:
    """The server SIGSTOPped for the block (yields when), always SIGCONTed after: a stopped process blocks teardown."""
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield time.monotonic()
    finally:
        os.kill(server.pid, signal.SIGCONT)


def _proxy(tmp_path: Path, *profiles: str) -> ProxyProcess:
    args = [a for p in profiles for a in ("--profile", p)]
    return ProxyProcess(*args, env={"ADAPTIVE_SPEC_STATE_DIR": str(tmp_path / "state")})


def _hang_and_come_back(proxy: ProxyProcess, server: LlamaServer, names: list[str], **headers: str) -> None:
    assert _chat(proxy, **headers)[0] == 200
    with _stopped(server) as stopped:
        wait_until(lambda: _all(proxy, names, up=False), DOWN_WITHIN_S, f"{names} to be marked down", interval=0.1)
        down_s = time.monotonic() - stopped
        reasons = {n: _profiles(proxy)[n]["reason"] for n in names}
        assert all(r == "health check: no answer in 3 s" for r in reasons.values()), reasons
        status, body, refused_s = _chat(proxy, **headers)
        assert status == 503, body
        assert refused_s < REFUSED_WITHIN_S, f"the refusal took {refused_s:.1f} s"
        error = body["error"]
        assert set(error) >= {"message", "type", "code"} and error["code"] == "profile_unavailable", body
        assert server.url in error["message"] and "is down: health check: no answer" in error["message"], error
        metrics = http_text(proxy.base + "/metrics", timeout=5)
        for name in names:
            assert f'adaptive_spec_profile_up{{profile="{name}"}} 0.0' in metrics
            assert f'adaptive_spec_replica_up{{profile="{name}",replica="0"}} 0.0' in metrics
            assert f'adaptive_spec_replica_marked_down_total{{profile="{name}",replica="0"}} 1.0' in metrics
    continued = time.monotonic()
    wait_until(lambda: _all(proxy, names, up=True), BACK_WITHIN_S, f"{names} to be marked up", interval=0.1)
    back_s = time.monotonic() - continued
    status, body, _ = _chat(proxy, **headers)
    assert status == 200, body
    metrics = http_text(proxy.base + "/metrics", timeout=5)
    assert all(f'adaptive_spec_profile_up{{profile="{n}"}} 1.0' in metrics for n in names)
    refused_ms = refused_s * 1000
    print(f"\n{names}: down {down_s:.1f} s after SIGSTOP, 503 in {refused_ms:.0f} ms, up {back_s:.1f} s after SIGCONT")


def test_a_hung_server_of_one_profile_is_refused_at_once_and_comes_back(
    tiny_server: LlamaServer, tmp_path: Path
) -> None:
    proxy = _proxy(tmp_path, f"solo={tiny_server.url}")
    try:
        _hang_and_come_back(proxy, tiny_server, ["solo"])  # unpinned: the router refuses its only profile
    finally:
        proxy.stop()


def test_two_profiles_on_one_hung_server_go_down_and_come_back_together(
    tiny_server: LlamaServer, tmp_path: Path
) -> None:
    proxy = _proxy(tmp_path, f"a={tiny_server.url}", f"b={tiny_server.url}")
    try:
        _hang_and_come_back(proxy, tiny_server, ["a", "b"], **{"x-adaptive-spec-profile": "b"})
    finally:
        proxy.stop()


@pytest.fixture(autouse=True)
def _never_left_stopped(tiny_server: LlamaServer) -> Iterator[None]:
    yield
    os.kill(tiny_server.pid, signal.SIGCONT)  # however a test ended, the module's server is running after it
