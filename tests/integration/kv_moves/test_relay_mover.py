"""KV moves between replicas on different "hosts" on REAL llama-servers (the tiny model): two servers of one profile,
each with its own slot directory and a kv-relay beside it, no directory shared. A session whose replica is overloaded
moves to the idle one with its KV through the relays (`cache_n` there shows the reuse, the greedy text equals a fresh
prefill's, the slot file is deleted on both sides); with the target's relay down the move re-prefills with the same
text; relays of two different models are refused at start with both hashes named."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from adaptive_spec.kv.slot_files import file_sha256
from tests.support.processes.relay import RelayProcess
from tests.support.processes.servers import LlamaServer, ProxyProcess, http_json

KEY = "mover-relay-key"
# No RAM prompt cache: a slot's prefill starts from what the slot holds, so a re-prefill on an erased slot is the
# same computation as a fresh server's (the random-weight model's near-ties flip on any other batching).
SERVER_ARGS = ("-c", "8192", "--parallel", "2", "--spec-type", "none", "--cache-ram", "0")
# A slow decode prior: a request queued ahead is priced at seconds (the short first turns teach no decode speed),
# so moving a few hundred tokens of KV across the link is worth it.
POLICY = "[estimator]\ndecode_tps = 2.0\n"
BUSY_SLOT = 1  # the three sessions that load replica 0 all use this slot; the moving ones hold slot 0
LONG_TOKENS = 2500  # with the ~1,100-token prompt, within a slot's 4,096


class Rig:
    def __init__(self, binary: str, gguf: Path, home: Path) -> None:
        self.home, self.gguf = home, gguf
        self.slot_dirs = [home / f"slots{i}" for i in range(2)]
        self.servers: list[LlamaServer] = []
        self.relays: list[RelayProcess] = []
        for slots in self.slot_dirs:
            slots.mkdir()
            server = LlamaServer(binary, gguf, *SERVER_ARGS, "--slot-save-path", str(slots), log_dir=home / "logs")
            self.servers.append(server)
            self.relays.append(RelayProcess(slots, gguf, KEY, server=server.url))
        (home / "relay.key").write_text(KEY + "\n")
        (home / "policy.toml").write_text(POLICY)
        args = [a for s in self.servers for a in ("--profile", f"plain={s.url}")]
        args += [a for s, r in zip(self.servers, self.relays, strict=True) for a in ("--relay", f"{s.url}={r.base}")]
        self.proxy = ProxyProcess(
            *args,
            "--relay-key-file",
            str(home / "relay.key"),
            "--policy",
            str(home / "policy.toml"),
            "--tokenizer",
            "off",
            env={"ADAPTIVE_SPEC_STATE_DIR": str(home / "state"), "ADAPTIVE_SPEC_CONFIG_DIR": str(home / "config")},
        )

    def stop(self) -> None:
        self.proxy.stop()
        for relay in self.relays:
            relay.stop()
        for server in self.servers:
            server.stop()

    def left_over(self) -> list[str]:
        return sorted(p.name for d in self.slot_dirs for p in d.iterdir())


@pytest.fixture(scope="module")
def rig(llama_server_binary: str, tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    rig = Rig(llama_server_binary, tiny_gguf, tmp_path_factory.mktemp("mover"))
    yield rig
    rig.stop()


def _body(messages: list[dict[str, str]], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": messages, "temperature": 0, "seed": 1, "max_tokens": max_tokens, **extra}


def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read()), resp.headers.get("x-adaptive-spec-request-id", "")


def _turn(rig: Rig, sid: str, messages: list[dict[str, str]], max_tokens: int, **extra: Any) -> dict[str, Any]:
    reply, request_id = _post(
        rig.proxy.base + "/v1/chat/completions", _body(messages, max_tokens, **extra), {"x-session-id": sid}
    )
    record = next(r for r in rig.proxy.requests() if r["request_id"] == request_id)
    return {**record, "text": reply["choices"][0]["message"]["content"]}


def _history(sid: str) -> list[dict[str, str]]:
    facts = " ".join(f"item {i} of {sid} weighs {i * 3 % 17} kg." for i in range(40))
    return [{"role": "user", "content": f"Session {sid}. {facts} Which item is heaviest?"}]


def _in_flight(rig: Rig, replica: int) -> int:
    return int(http_json(rig.proxy.base + "/adaptive/profiles")["profiles"][0]["replicas"][replica]["in_flight"])


def _overload_replica_0(rig: Rig, pool: ThreadPoolExecutor, loaders: list[str]) -> list[Future[Any]]:
    """Three long answers for sessions placed on replica 0, all in its slot BUSY_SLOT: its slots are all busy (by
    the router's count) with one queued, while the moving session's own slot stays idle."""
    url = rig.proxy.base + "/v1/chat/completions"
    futures = [
        pool.submit(
            _post, url, _body(_history(sid), LONG_TOKENS, id_slot=BUSY_SLOT, ignore_eos=True), {"x-session-id": sid}
        )
        for sid in loaders
    ]
    deadline = time.monotonic() + 60
    while _in_flight(rig, 0) < len(loaders):
        assert time.monotonic() < deadline, "the loading requests did not reach the proxy"
        time.sleep(0.01)
    return futures


def _served_in_full(futures: list[Future[Any]]) -> None:
    for future in futures:
        reply, _ = future.result()
        assert reply["usage"]["completion_tokens"] == LONG_TOKENS, reply["usage"]


def _direct(server: LlamaServer, messages: list[dict[str, str]], max_tokens: int) -> str:
    """The same request straight to a server, prefilling everything (no cache reused)."""
    reply, _ = _post(server.url + "/v1/chat/completions", _body(messages, max_tokens, cache_prompt=False))
    return str(reply["choices"][0]["message"]["content"])


def test_a_session_moves_to_the_idle_replica_with_its_kv_through_the_relays(rig: Rig) -> None:
    # First turns, one at a time: least loaded first spreads them s, a, x, b, y, c, z → 0, 1, 0, 1, 0, 1, 0 (a takes
    # slot 0 of replica 1 as s does of replica 0, so that neither replica has more never used slots at a tie).
    placed = {}
    for sid in ("s", "a", "x", "b", "y", "c", "z"):
        extra = {"id_slot": 0 if sid in ("s", "a") else BUSY_SLOT}
        placed[sid] = _turn(rig, sid, _history(sid), 8, **extra)["replica"]
    assert placed == {"s": 0, "a": 1, "x": 0, "b": 1, "y": 0, "c": 1, "z": 0}, placed

    with ThreadPoolExecutor(3) as pool:
        loaders = _overload_replica_0(rig, pool, ["x", "y", "z"])
        messages = _history("s")
        record = _turn(rig, "s", messages, 16)
        _served_in_full(loaders)
    assert record["status"] == 200 and record["replica"] == 1, record["reason"]
    assert record["replica_moved_from"] == 0 and "hands its KV over" in record["reason"], record["reason"]
    handoff = record["handoff"]
    assert handoff["ok"], handoff
    assert handoff["bytes"] > 0 and handoff["transfer_s"] > 0 and handoff["tokens"] >= 300, handoff
    # The restored KV is reused on the target: only the tail of the prompt is evaluated there.
    assert record["timings"]["cache_n"] >= handoff["tokens"] - 16, record["timings"]
    assert record["timings"]["prompt_n"] < 16, record["timings"]
    assert record["text"] == _direct(rig.servers[1], messages, 16)
    assert rig.left_over() == []  # the slot file is gone on both sides
    priced = http_json(rig.proxy.base + "/adaptive/route")["kv_transfer"]
    assert priced["bytes_per_token"] == round(handoff["bytes"] / handoff["tokens"], 1), priced  # the file's measure
    print(
        f"\nrelay move, tiny model: {handoff['tokens']} tokens, {handoff['bytes']} bytes "
        f"({handoff['bytes'] / handoff['tokens']:.0f} B/token): save {handoff['save_s'] * 1000:.1f} ms, transfer "
        f"{handoff['transfer_s'] * 1000:.1f} ms, restore {handoff['restore_s'] * 1000:.1f} ms"
    )


def test_with_the_target_relay_down_the_moving_session_re_prefills_with_the_same_text(rig: Rig) -> None:
    placed = _turn(rig, "t", _history("t"), 8, id_slot=0)["replica"]
    assert placed == 0  # replica 1 now holds more sessions (a, b, c, s)
    rig.relays[1].stop()
    for slot in range(2):  # replica 1's slots empty: its re-prefill starts from nothing, as a fresh server's does
        _post(f"{rig.servers[1].url}/slots/{slot}?action=erase", {})
    with ThreadPoolExecutor(3) as pool:
        loaders = _overload_replica_0(rig, pool, ["x", "y", "z"])
        messages = _history("t")
        record = _turn(rig, "t", messages, 16)
        _served_in_full(loaders)
    assert record["status"] == 200 and record["replica"] == 1, record["reason"]
    handoff = record["handoff"]
    assert handoff is not None and not handoff["ok"] and rig.relays[1].base.split("//")[1] in handoff["error"], handoff
    assert record["text"] == _direct(rig.servers[1], messages, 16)
    assert rig.left_over() == []  # deleted at the source; never uploaded to the target


def test_relays_of_different_models_are_refused_at_start(rig: Rig, tmp_path: Path) -> None:
    other = tmp_path / "other.gguf"
    shutil.copyfile(rig.gguf, other)
    with other.open("ab") as fh:
        fh.write(b"\0")
    dirs = [tmp_path / "a", tmp_path / "b"]
    for d in dirs:
        d.mkdir()
    relays = [RelayProcess(dirs[0], rig.gguf, KEY), RelayProcess(dirs[1], other, KEY)]
    try:
        argv = [sys.executable, "-m", "adaptive_spec", "serve", "--port", "0", "--tokenizer", "off"]
        argv += [a for s in rig.servers for a in ("--profile", f"plain={s.url}")]
        argv += [a for s, r in zip(rig.servers, relays, strict=True) for a in ("--relay", f"{s.url}={r.base}")]
        env = {**os.environ, "ADAPTIVE_SPEC_STATE_DIR": str(tmp_path / "state"), "ADAPTIVE_SPEC_RELAY_KEY": KEY}
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=False)
    finally:
        for relay in relays:
            relay.stop()
    assert done.returncode != 0
    assert "the kv-relays serve different models" in done.stderr, done.stderr
    assert file_sha256(rig.gguf) in done.stderr and file_sha256(other) in done.stderr
    assert relays[0].base in done.stderr and relays[1].base in done.stderr
