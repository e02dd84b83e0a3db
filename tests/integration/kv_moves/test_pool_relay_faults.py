"""Pools and kv-relays under faults, on REAL llama-servers (the tiny random-weight model) and real relays.

KV moves between hosts: profiles a and b on two servers, each with its own slot directory and a relay beside it, none
shared; a session pinned from one to the other takes its KV along through the relays. A relay that stalls, answers
garbage or disappears in the middle of that transfer costs a bounded wait and a re-prefill: the request succeeds, its
record says the handoff failed in one short line, no slot file or partial upload stays in either slot directory (a
relay that was killed clears its own when it starts again), and the session's next request is served. What the real
relay cannot be made to do on demand (stall or reset the connection after part of a file, answer with a page, a body
that is no slot file, or an upload answer that is not JSON) is injected on the wire in front of it
(`tests/support/fakes/faulty_relay.py`); stopping and killing are done to the real relay process.

Pools: a replica that comes back on its address serving another model is kept down, naming both; a pool whose every
replica is down is refused at once in OpenAI's error shape naming the profile, and served again when one returns.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from adaptive_spec.relay.service import RATE_ENV, sweep_slot_files
from tests.support.fakes.faulty_relay import FaultyRelay
from tests.support.models.tiny_gguf import write_tiny_gguf
from tests.support.processes.relay import RelayProcess
from tests.support.processes.servers import LlamaServer, ProxyProcess, http_json, wait_until

KEY = "faults-relay-key"
SERVER_ARGS = ("-c", "4096", "--parallel", "1", "--spec-type", "none", "--cache-ram", "0")
POLICY = "[handoff]\nmin_tokens = 256\n"
# Server b's relay takes uploads at this rate: a slot file (~0.8 MB) takes seconds to arrive there, so a test can act
# while one is under way, seen by the hidden partial file growing in b's slot directory.
TARGET_RATE_BPS = 250_000
# What a failed move may cost: its copy given up once no byte crossed for the slot action's deadline (10 s + 0.5 ms
# per cached token, ~11 s here), and the deletes (5 s); not the 60 s a silent download is given nor the request's own
# 600 s.
MOVE_BOUND_S = 30.0


def _relay_at(port: int, slot_dir: Path, gguf: Path, server: str, env: dict[str, str]) -> RelayProcess:
    """A relay on a given port, as one that comes back where the proxy knows it (the later --port wins)."""
    relay = RelayProcess(slot_dir, gguf, KEY, "--port", str(port), server=server, env=env)
    relay.port, relay.base = port, f"http://127.0.0.1:{port}"
    return relay


class MoveRig:
    """Profile a on server 0, whose relay the proxy reaches through a fault injector; profile b on server 1, whose
    relay (throttled uploads) it reaches directly."""

    def __init__(self, binary: str, gguf: Path, home: Path) -> None:
        self.home, self.gguf = home, gguf
        self.slot_dirs = [home / f"slots{i}" for i in range(2)]
        self.servers: list[LlamaServer] = []
        for slots in self.slot_dirs:
            slots.mkdir()
            self.servers.append(
                LlamaServer(binary, gguf, *SERVER_ARGS, "--slot-save-path", str(slots), log_dir=home / "logs")
            )
        self.relays = [
            RelayProcess(self.slot_dirs[0], gguf, KEY, server=self.servers[0].url),
            RelayProcess(self.slot_dirs[1], gguf, KEY, server=self.servers[1].url, env=self.target_env),
        ]
        self.faulty = FaultyRelay(self.relays[0].base)
        (home / "relay.key").write_text(KEY + "\n")
        (home / "policy.toml").write_text(POLICY)
        relay_urls = [self.faulty.base, self.relays[1].base]
        self.proxy = ProxyProcess(
            *[a for p, s in zip("ab", self.servers, strict=True) for a in ("--profile", f"{p}={s.url}")],
            *[a for s, u in zip(self.servers, relay_urls, strict=True) for a in ("--relay", f"{s.url}={u}")],
            "--relay-key-file",
            str(home / "relay.key"),
            "--policy",
            str(home / "policy.toml"),
            "--tokenizer",
            "off",
            env={"ADAPTIVE_SPEC_STATE_DIR": str(home / "state"), "ADAPTIVE_SPEC_CONFIG_DIR": str(home / "config")},
        )

    @property
    def target_env(self) -> dict[str, str]:
        return {RATE_ENV: str(TARGET_RATE_BPS)}

    def restart_relay_1(self) -> None:
        self.relays[1].stop()
        self.relays[1] = _relay_at(
            self.relays[1].port, self.slot_dirs[1], self.gguf, self.servers[1].url, self.target_env
        )

    def stop(self) -> None:
        self.proxy.stop()
        self.faulty.stop()
        for relay in self.relays:
            relay.stop()
        for server in self.servers:
            server.stop()

    def left_over(self) -> dict[str, list[str]]:
        """Every file in either slot directory, hidden partial uploads included (those with one)."""
        return {d.name: sorted(p.name for p in d.iterdir()) for d in self.slot_dirs if any(d.iterdir())}

    def uploading(self) -> bool:
        return any(p.name.startswith(".part-") and p.stat().st_size > 0 for p in self.slot_dirs[1].iterdir())


@pytest.fixture(scope="module")
def rig(llama_server_binary: str, tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MoveRig]:
    rig = MoveRig(llama_server_binary, tiny_gguf, tmp_path_factory.mktemp("relay-faults"))
    yield rig
    rig.stop()


def _post(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[int, dict[str, Any], dict[str, str]]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **headers}
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def _turn(proxy: ProxyProcess, sid: str, messages: list[dict[str, str]], profile: str | None = None) -> dict[str, Any]:
    """One greedy turn of session `sid` (pinned to `profile`): its record with the HTTP status, the answer's body and
    text, and the wall time added."""
    headers = {"x-session-id": sid, **({"x-adaptive-spec-profile": profile} if profile else {})}
    body = {"model": "m", "messages": messages, "temperature": 0, "seed": 1, "max_tokens": 8}
    t0 = time.monotonic()
    status, reply, got = _post(proxy.base + "/v1/chat/completions", body, headers)
    elapsed_s = time.monotonic() - t0
    record = next(r for r in proxy.requests() if r["request_id"] == got["x-adaptive-spec-request-id"])
    text = reply["choices"][0]["message"]["content"] if status == 200 else None
    return {**record, "http": status, "body": reply, "text": text, "elapsed_s": elapsed_s}


def _history(sid: str) -> list[dict[str, str]]:
    facts = " ".join(f"item {i} of {sid} weighs {i * 3 % 17} kg." for i in range(40))  # ~1,400 tokens
    return [{"role": "user", "content": f"Session {sid}. {facts} Which item is heaviest?"}]


def _move(
    rig: MoveRig, sid: str, source: str, target: str, during: Callable[[], None] | None = None
) -> tuple[dict[str, Any], list[dict[str, str]]]:
    """Turn 1 on `source`, then turn 2 pinned to `target`, which moves the session's KV through the relays while
    `during()` runs beside it. Turn 2's record, and the history for turn 3."""
    messages = _history(sid)
    first = _turn(rig.proxy, sid, messages, source)
    assert first["http"] == 200, first
    messages += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "And the lightest?"}]
    with ThreadPoolExecutor(1) as pool:
        beside = pool.submit(during) if during is not None else None
        moved = _turn(rig.proxy, sid, messages, target)
        if beside is not None:
            beside.result(120)
    assert moved["route"] == "pinned" and moved["moved_from"] == source, moved["reason"]
    messages += [{"role": "assistant", "content": moved["text"] or ""}, {"role": "user", "content": "Thanks."}]
    return moved, messages


def _failed_cleanly(moved: dict[str, Any], says: str) -> None:
    """The move failed in one short line saying `says`, within the bound, and the request re-prefilled and
    succeeded."""
    handoff = moved["handoff"]
    assert moved["http"] == 200 and moved["status"] == 200, moved["body"]
    assert handoff is not None and not handoff["ok"], handoff
    error = handoff["error"]
    assert says in error and len(error) <= 300 and error.isprintable(), error
    assert moved["elapsed_s"] < MOVE_BOUND_S, moved["elapsed_s"]
    # Re-prefilled: of the ~1,400-token prompt, only the chat template's opening matched the target slot.
    assert moved["timings"]["cache_n"] < 100 and moved["timings"]["prompt_n"] > 1000, moved["timings"]
    print(f"\n{moved['session_id']}: failed move in {moved['elapsed_s']:.2f} s: {error}")


def _nothing_left(rig: MoveRig) -> None:
    # A relay notices an upload broken off at its next read (a throttled one, at its next chunk): soon, not at once.
    wait_until(lambda: rig.left_over() == {}, 10, f"empty slot directories, not {rig.left_over()}")


def _next_turn_served(rig: MoveRig, sid: str, messages: list[dict[str, str]], profile: str) -> None:
    after = _turn(rig.proxy, sid, messages, profile)
    assert after["http"] == 200 and after["handoff"] is None, after
    assert after["timings"]["cache_n"] > 1000, after["timings"]  # on the KV its re-prefill left there


def _wait(predicate: Callable[[], bool], what: str) -> None:
    wait_until(predicate, 60, what, interval=0.005)


def test_a_move_through_the_relays_takes_the_kv_along(rig: MoveRig) -> None:
    moved, _ = _move(rig, "healthy", "a", "b")
    handoff = moved["handoff"]
    assert handoff["ok"] and handoff["bytes"] > 0, handoff
    assert moved["timings"]["cache_n"] >= handoff["tokens"] - 16, moved["timings"]
    assert rig.left_over() == {}


@pytest.mark.parametrize(
    ("fault", "source", "target", "says"),
    [
        ("stall", "a", "b", "from http://127.0.0.1:{port} to http://127.0.0.1:{b}: gave up after"),  # 64 KiB, silence
        ("reset", "a", "b", "the download from http://127.0.0.1:{port} broke off after 65536 bytes"),  # then RST
        ("html", "a", "b", "at http://127.0.0.1:{port}: the answer carries no x-adaptive-spec-sha256"),  # a web page
        ("not-a-slot-file", "a", "b", "invalid slot save file"),  # checksums match; the target's server refuses it
        ("garbage-answer", "b", "a", "at http://127.0.0.1:{port}: not a relay's answer: <html>"),  # upload landed
    ],
)
def test_a_relay_that_stalls_answers_garbage_or_breaks_off_costs_a_re_prefill(
    rig: MoveRig, fault: str, source: str, target: str, says: str
) -> None:
    rig.faulty.fault = fault
    try:
        moved, messages = _move(rig, f"wire-{fault}", source, target)
    finally:
        rig.faulty.fault = ""
    assert rig.faulty.faulted, "the fault was never injected"
    rig.faulty.faulted.clear()
    _failed_cleanly(moved, says.format(port=rig.faulty.port, b=rig.relays[1].port))
    _nothing_left(rig)
    _next_turn_served(rig, f"wire-{fault}", messages, target)


def test_a_target_relay_stopped_mid_upload_is_given_up_at_the_copy_deadline(rig: MoveRig) -> None:
    pid = rig.relays[1].proc.pid

    def stop_mid_upload() -> None:
        _wait(rig.uploading, "the upload to b's relay")
        os.kill(pid, signal.SIGSTOP)  # a real stall: the relay took part of the file and reads nothing more

    try:
        moved, messages = _move(rig, "relay-stopped", "a", "b", stop_mid_upload)
        # Its partial upload is the stopped relay's own: hidden, never a slot file a restore could read.
        assert [n.startswith(".part-") for n in rig.left_over().get("slots1", [])] == [True], rig.left_over()
    finally:
        os.kill(pid, signal.SIGCONT)
    _failed_cleanly(moved, "gave up after")
    _nothing_left(rig)  # the relay, running again, finds the upload gone and removes its partial
    _next_turn_served(rig, "relay-stopped", messages, "b")


def test_a_target_relay_killed_mid_upload_leaves_only_a_hidden_partial_swept_at_its_restart(rig: MoveRig) -> None:
    pid = rig.relays[1].proc.pid

    def kill_mid_upload() -> None:
        _wait(rig.uploading, "the upload to b's relay")
        os.kill(pid, signal.SIGKILL)

    moved, messages = _move(rig, "relay-killed", "a", "b", kill_mid_upload)
    _failed_cleanly(moved, f"the upload to {rig.relays[1].base} broke off after")
    left = rig.left_over()
    assert list(left) == ["slots1"] and [n.startswith(".part-") for n in left["slots1"]] == [True], left
    rig.restart_relay_1()
    assert rig.left_over() == {}
    _next_turn_served(rig, "relay-killed", messages, "b")


def test_a_source_relay_killed_keeps_the_saved_slot_file_only_until_it_restarts(rig: MoveRig) -> None:
    messages = _history("source-killed")
    first = _turn(rig.proxy, "source-killed", messages, "b")
    messages += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "And the lightest?"}]
    os.kill(rig.relays[1].proc.pid, signal.SIGKILL)
    moved = _turn(rig.proxy, "source-killed", messages, "a")
    assert moved["moved_from"] == "b", moved["reason"]
    # A fresh connection is refused; one the proxy kept alive from an earlier move is reset: either says it is gone.
    gone = "reset by peer" if "reset by peer" in (moved["handoff"] or {}).get("error", "") else "refused"
    _failed_cleanly(moved, f"the download from {rig.relays[1].base} failed: connection {gone}")
    # b's server saved the slot; only its relay, now gone, could delete the file there.
    left = rig.left_over()
    assert list(left) == ["slots1"] and [n.startswith("as-") for n in left["slots1"]] == [True], left
    rig.restart_relay_1()
    assert rig.left_over() == {}
    messages += [{"role": "assistant", "content": moved["text"]}, {"role": "user", "content": "Thanks."}]
    _next_turn_served(rig, "source-killed", messages, "a")


def test_a_relay_sweeps_the_slot_files_no_delete_reached(tmp_path: Path) -> None:
    old, new, theirs = tmp_path / "as-0123-1.bin", tmp_path / "as-0123-2.bin", tmp_path / "user-slot.bin"
    for path in (old, new, theirs):
        path.write_bytes(b"kv")
    an_hour_ago = time.time() - 3600
    for path in (old, theirs):
        os.utime(path, (an_hour_ago, an_hour_ago))
    assert sweep_slot_files(tmp_path) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [new.name, theirs.name]


# --- pools ------------------------------------------------------------------------------------------------------

POOL_ARGS = ("-c", "4096", "--parallel", "2", "--spec-type", "none")


class Pool:
    """One profile, "plain", on two attached llama-servers."""

    def __init__(self, binary: str, gguf: Path, home: Path) -> None:
        self.binary, self.gguf, self.home = binary, gguf, home
        self.servers = [LlamaServer(binary, gguf, *POOL_ARGS, log_dir=home / "logs") for _ in range(2)]
        env = {"ADAPTIVE_SPEC_STATE_DIR": str(home / "state"), "ADAPTIVE_SPEC_CONFIG_DIR": str(home / "config")}
        self.proxy = ProxyProcess(
            *[a for s in self.servers for a in ("--profile", f"plain={s.url}")], "--tokenizer", "off", env=env
        )

    def replicas(self) -> list[dict[str, Any]]:
        return list(http_json(self.proxy.base + "/adaptive/profiles")["profiles"][0]["replicas"])

    def kill(self, i: int) -> None:
        os.kill(self.servers[i].pid, signal.SIGKILL)

    def bring_back(self, i: int, model: Path) -> None:
        """Server i (stopped, if it still ran) comes back on its own port, running `model`."""
        self.servers[i].stop()
        port = self.servers[i].port
        self.servers[i] = LlamaServer(self.binary, model, *POOL_ARGS, log_dir=self.home / "logs", port=port)

    def stop(self) -> None:
        self.proxy.stop()
        for server in self.servers:
            server.stop()


@pytest.fixture
def pool(llama_server_binary: str, tiny_gguf: Path, tmp_path: Path) -> Iterator[Pool]:
    pool = Pool(llama_server_binary, tiny_gguf, tmp_path)
    yield pool
    pool.stop()


def _ask(sid: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Session {sid}: count to five."}]


def _direct(server: LlamaServer, messages: list[dict[str, str]]) -> str:
    body = {"model": "m", "messages": messages, "temperature": 0, "seed": 1, "max_tokens": 8}
    status, reply, _ = _post(server.url + "/v1/chat/completions", body, {})
    assert status == 200, reply
    return str(reply["choices"][0]["message"]["content"])


def test_a_replica_that_comes_back_serving_another_model_is_kept_down(pool: Pool, tmp_path: Path) -> None:
    other = write_tiny_gguf(tmp_path / "other-tiny.gguf", seed=1)
    assert [_turn(pool.proxy, sid, _ask(sid))["replica"] for sid in ("m0", "m1")] == [0, 1]
    pool.kill(1)
    wait_until(lambda: not pool.replicas()[1]["up"], 30, "replica #1 marked down")
    pool.bring_back(1, other)
    wait_until(lambda: "other-tiny.gguf" in str(pool.replicas()[1]["reason"]), 15, "the other model named")
    replica = pool.replicas()[1]
    assert not replica["up"] and "'tiny-random-llama.gguf'" in replica["reason"], replica
    # Its old session (m1, whose KV was there) and new ones are all served by the pool's model, on replica #0.
    for sid in ("m1", "m2", "m3"):
        record = _turn(pool.proxy, sid, _ask(sid))
        assert record["http"] == 200 and record["replica"] == 0, record["reason"]
        assert record["text"] == _direct(pool.servers[0], _ask(sid))
    # The pool's model back on that port: the replica is taken back, and the least loaded takes a new session.
    pool.bring_back(1, pool.gguf)
    wait_until(lambda: pool.replicas()[1]["up"], 15, "replica #1 up again")
    assert _turn(pool.proxy, "m4", _ask("m4"))["replica"] == 1


def _refused(record: dict[str, Any], limit_s: float) -> dict[str, Any]:
    """An OpenAI-shaped error body naming the profile, answered within `limit_s`; the error."""
    error = record["body"]["error"]
    assert {"message", "type", "code"} <= set(error) and "'plain'" in error["message"], record["body"]
    assert record["elapsed_s"] < limit_s, record["elapsed_s"]
    return dict(error)


def test_a_pool_with_every_replica_down_is_refused_at_once_and_served_when_one_returns(pool: Pool) -> None:
    assert _turn(pool.proxy, "z", _ask("z"))["http"] == 200
    pool.kill(0)
    pool.kill(1)
    killed = time.monotonic()
    # At once, before any health check: each replica refuses the connection, and the answer says so.
    first = _turn(pool.proxy, "z", _ask("z"))
    assert first["http"] in (502, 503), first["body"]
    _refused(first, 5.0)
    # Once the health poll has found both refusing (its next round): 503, without trying them.
    wait_until(lambda: not any(r["up"] for r in pool.replicas()), 30, "every replica marked down")
    all_down_s = time.monotonic() - killed
    down = _turn(pool.proxy, "z", _ask("z"))
    assert down["http"] == 503 and _refused(down, 1.0)["code"] == "profile_unavailable", down["body"]
    # One comes back: the watch (every second) finds it, and the session is served there.
    pool.bring_back(0, pool.gguf)
    returned = time.monotonic()
    wait_until(lambda: pool.replicas()[0]["up"], 15, "replica #0 up again")
    up_s = time.monotonic() - returned
    back = _turn(pool.proxy, "z", _ask("z"))
    assert back["http"] == 200 and back["replica"] == 0, back["reason"]
    assert back["text"] == _direct(pool.servers[0], _ask("z"))
    print(
        f"\nevery replica down: first answer {first['http']} in {first['elapsed_s'] * 1000:.0f} ms; all marked down "
        f"{all_down_s:.1f} s after the kill, then {down['http']} in {down['elapsed_s'] * 1000:.0f} ms "
        f"({down['body']['error']['message']}); back up {up_s:.1f} s after its server was healthy"
    )


def test_after_the_last_replica_refused_the_next_request_is_a_503_at_once(pool: Pool) -> None:
    """The request that finds the last replica refusing gets the refusal (502, naming the profile): it was tried.
    That replica is marked down there and then, so the next one is refused at once (503) without trying it, before
    the health poll's next round."""
    assert _turn(pool.proxy, "y", _ask("y"))["http"] == 200
    pool.kill(0)
    pool.kill(1)
    first = _turn(pool.proxy, "y", _ask("y"))
    assert first["http"] in (502, 503), first["body"]
    if first["http"] == 502:  # the poll had not yet marked both down
        assert _refused(first, 5.0)["code"] == "upstream_unreachable", first["body"]
    second = _turn(pool.proxy, "y", _ask("y"))
    assert second["http"] == 503 and _refused(second, 1.0)["code"] == "profile_unavailable", second["body"]
