"""Replica pools on real llama-servers (the tiny random-weight model): one profile served by two servers, sessions
spread over both and kept on theirs, one server SIGKILLed and its sessions re-placed on the other with every answer
200 and the same greedy text as the survivor gives directly; replicas that serve different models refused."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes.servers import LlamaServer, ProxyProcess, http_json, http_text

SERVER_ARGS = ("-c", "4096", "--parallel", "2", "--metrics", "--spec-type", "none")
SESSIONS = [f"pool-{i}" for i in range(8)]


@pytest.fixture(scope="module")
def pool(
    llama_server_binary: str, tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ProxyProcess, list[LlamaServer]]]:
    home = tmp_path_factory.mktemp("pool")
    # Each server has its own slot directory (as on two hosts): slot actions work, no KV moves between them.
    for i in range(2):
        (home / f"slots{i}").mkdir()
    servers = [
        LlamaServer(
            llama_server_binary,
            tiny_gguf,
            *SERVER_ARGS,
            "--slot-save-path",
            str(home / f"slots{i}"),
            log_dir=home / "logs",
        )
        for i in range(2)
    ]
    env = {"ADAPTIVE_SPEC_STATE_DIR": str(home / "state"), "ADAPTIVE_SPEC_CONFIG_DIR": str(home / "config")}
    args = [a for s in servers for a in ("--profile", f"plain={s.url}")]
    proxy = ProxyProcess(*args, "--tokenizer", "off", env=env)
    yield proxy, servers
    proxy.stop()
    for server in servers:
        server.stop()


def _body(messages: list[dict[str, str]]) -> dict[str, Any]:
    return {"model": "m", "messages": messages, "temperature": 0, "seed": 1, "max_tokens": 12}


def _post(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, dict[str, Any], dict[str, str]]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **headers}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return resp.status, json.loads(resp.read()), dict(resp.headers)


def _turn(proxy: ProxyProcess, sid: str, history: list[dict[str, str]]) -> dict[str, Any]:
    status, reply, headers = _post(proxy.base + "/v1/chat/completions", _body(history), {"x-session-id": sid})
    request_id = headers["x-adaptive-spec-request-id"]
    record = next(r for r in proxy.requests() if r["request_id"] == request_id)
    text = reply["choices"][0]["message"]["content"]
    return {**record, "http": status, "text": text, "header_replica": int(headers["x-adaptive-spec-replica"])}


def test_sessions_spread_stay_and_survive_a_killed_replica(pool: tuple[ProxyProcess, list[LlamaServer]]) -> None:
    proxy, servers = pool
    histories = {
        sid: [{"role": "user", "content": f"Session {sid}: say something about the number {n}."}]
        for n, sid in enumerate(SESSIONS)
    }
    placed: dict[str, int] = {}
    for turn in range(2):
        for sid in SESSIONS:
            record = _turn(proxy, sid, histories[sid])
            assert record["http"] == 200 and record["status"] == 200
            assert record["replica"] == record["header_replica"]
            if turn == 0:
                placed[sid] = record["replica"]
            else:  # the second turn stays where the first left its KV cache
                assert record["replica"] == placed[sid], record["reason"]
                assert record["timings"]["cache_n"] > 0, record["timings"]
            histories[sid] += [
                {"role": "assistant", "content": record["text"]},
                {"role": "user", "content": f"And again, turn {turn + 2}."},
            ]
    assert sorted(placed.values()).count(0) == 4, placed  # least loaded first: spread evenly
    profiles = http_json(proxy.base + "/adaptive/profiles")["profiles"]
    assert [r["sessions"] for r in profiles[0]["replicas"]] == [4, 4]
    assert [r["requests"] for r in profiles[0]["replicas"]] == [8, 8]

    os.kill(servers[1].pid, signal.SIGKILL)
    survivor = servers[0]
    for sid in SESSIONS:
        record = _turn(proxy, sid, histories[sid])
        assert record["http"] == 200 and record["status"] == 200 and record["replica"] == 0, record
        if placed[sid] == 1:
            assert "replica #1 is down" in record["reason"], record["reason"]
            assert record["replica_moved_from"] == 1
        # The same request sent straight to the survivor gives the same greedy text.
        _, direct, _ = _post(survivor.url + "/v1/chat/completions", _body(histories[sid]), {})
        assert record["text"] == direct["choices"][0]["message"]["content"]

    profiles = http_json(proxy.base + "/adaptive/profiles")["profiles"]
    replicas = profiles[0]["replicas"]
    assert profiles[0]["up"] and [r["up"] for r in replicas] == [True, False], replicas
    assert replicas[0]["sessions"] == 8
    metrics = http_text(proxy.base + "/metrics")
    assert 'adaptive_spec_replica_up{profile="plain",replica="1"} 0.0' in metrics
    assert 'adaptive_spec_profile_up{profile="plain"} 1.0' in metrics
    assert 'adaptive_spec_replica_moves_total{from_replica="1",profile="plain",to_replica="0"} 4.0' in metrics
    # Erasing the profile empties the replica that is up (the one down is asked nothing).
    try:
        status, erased, _ = _post(proxy.base + "/adaptive/profiles/plain/erase", {}, {})
    except urllib.error.HTTPError as exc:
        raise AssertionError(exc.read().decode()) from exc
    assert status == 200 and erased["slots"] == 2, erased


def test_replicas_serving_different_models_are_refused(
    llama_server_binary: str, tiny_gguf: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other-model.gguf"
    shutil.copyfile(tiny_gguf, other)
    servers = [
        LlamaServer(llama_server_binary, model, *SERVER_ARGS, log_dir=tmp_path / "logs") for model in (tiny_gguf, other)
    ]
    try:
        argv = [sys.executable, "-m", "adaptive_spec", "serve", "--port", "0", "--tokenizer", "off"]
        argv += [a for s in servers for a in ("--profile", f"plain={s.url}")]
        env = {**os.environ, "ADAPTIVE_SPEC_STATE_DIR": str(tmp_path / "state")}
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=False)
    finally:
        for server in servers:
            server.stop()
    assert done.returncode != 0
    assert "the replicas of profile 'plain' serve different models" in done.stderr, done.stderr
    assert servers[0].url in done.stderr and servers[1].url in done.stderr
    assert "'other-model.gguf'" in done.stderr


def test_a_replica_killed_between_requests_is_found_down_by_the_health_poll(
    llama_server_binary: str, tiny_gguf: Path, tmp_path: Path
) -> None:
    servers = [LlamaServer(llama_server_binary, tiny_gguf, *SERVER_ARGS, log_dir=tmp_path / "logs") for _ in range(2)]
    env = {"ADAPTIVE_SPEC_STATE_DIR": str(tmp_path / "state"), "ADAPTIVE_SPEC_CONFIG_DIR": str(tmp_path / "config")}
    proxy = ProxyProcess(*[a for s in servers for a in ("--profile", f"plain={s.url}")], "--tokenizer", "off", env=env)
    try:
        history = {sid: [{"role": "user", "content": f"Session {sid}: count to five."}] for sid in ("p0", "p1")}
        assert [_turn(proxy, sid, history[sid])["replica"] for sid in ("p0", "p1")] == [0, 1]
        os.kill(servers[1].pid, signal.SIGKILL)
        # No request reaches the dead server: the poll (every few seconds) marks it down first.
        deadline = time.monotonic() + 60
        while (replica := http_json(proxy.base + "/adaptive/profiles")["profiles"][0]["replicas"][1])["up"]:
            assert time.monotonic() < deadline, "the health poll did not mark the killed replica down"
            time.sleep(0.2)
        assert replica["reason"] == "health check: connection refused", replica
        record = _turn(proxy, "p1", history["p1"])
        assert record["http"] == 200 and record["replica"] == 0 and record["replica_moved_from"] == 1
        assert "replica #1 is down (health check: connection refused); re-prefills" in record["reason"]
        _, direct, _ = _post(servers[0].url + "/v1/chat/completions", _body(history["p1"]), {})
        assert record["text"] == direct["choices"][0]["message"]["content"]
    finally:
        proxy.stop()
        for server in servers:
            server.stop()
