"""KV moves, a replica pool and remote prefill between hosts that are hosts: REAL llama-servers (the tiny model,
`-t 1`) each with its kv-relay in two network namespaces of their own ("host0", "host1"), `serve` in a third
("proxy"), the test as a client on the same switch (`tests/support/processes/hosts.py`). Nothing is on loopback: every
call crosses a veth. The pool spans both hosts; a session moves with its KV through the relays (`cache_n` on the
other host shows it arrived); a long prompt is prefilled on host1 and decoded on host0; and host0's link taken down
while a slot file is on its way costs a re-prefill and no failed request.

Only the network is private to a namespace: remote prefill's local server (host0) and `serve` share the slot
directory as a shared filesystem would, which `serve --slot-dir` expects."""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes.hosts import Hosts
from tests.support.processes.relay import RelayProcess
from tests.support.processes.servers import LlamaServer, ProxyProcess, http_json, wait_until

KEY = "hosts-relay-key"
# As in test_relay_mover: no RAM prompt cache, so a re-prefill starts from what the slot holds.
SERVER_ARGS = ("-c", "8192", "--parallel", "2", "--spec-type", "none", "--cache-ram", "0")
POLICY = "[estimator]\ndecode_tps = 0.5\n"  # a request queued ahead is priced at ~16 s: moving KV is worth it
PP_POLICY = "[estimator]\nprefill_tps = 20.0\n"  # a slow local box: a long prompt is worth prefilling on host1
BUSY_SLOT = 1
LONG_TOKENS = 2500
SLOW_LINK = "1mbit"  # the ~600 kB slot file takes ~5 s over it: time to pull the cable mid-move
LONG = "Here is the log:\n" + "\n".join(f"line {i}: value={i * 7 % 13} status=ok" for i in range(140)) + "\nSum up."


class Rig:
    """The three hosts and what runs on them; the pool's proxy at start, remote prefill's proxy when asked."""

    def __init__(self, hosts: Hosts, binary: str, gguf: Path, home: Path) -> None:
        self.hosts, self.home, self.gguf = hosts, home, gguf
        self.slot_dirs = [home / f"slots{i}" for i in range(2)]
        self.servers: list[LlamaServer] = []
        self.relays: list[RelayProcess] = []
        self.proxies: list[ProxyProcess] = []
        (home / "relay.key").write_text(KEY + "\n")
        for i, slots in enumerate(self.slot_dirs):
            slots.mkdir()
            host, wrap = hosts.address(f"host{i}"), hosts.run(f"host{i}")
            server_args = (*SERVER_ARGS, "--slot-save-path", str(slots))
            server = LlamaServer(binary, gguf, *server_args, log_dir=home / "logs", host=host, wrap=wrap)
            self.servers.append(server)
            self.relays.append(RelayProcess(slots, gguf, KEY, server=server.url, host=host, wrap=wrap))
        args = [a for s in self.servers for a in ("--profile", f"plain={s.url}")]
        args += [a for s, r in zip(self.servers, self.relays, strict=True) for a in ("--relay", f"{s.url}={r.base}")]
        self.pool = self.proxy("pool", POLICY, *args, "--tokenizer", "off")

    def proxy(self, name: str, policy: str, *args: str) -> ProxyProcess:
        (self.home / f"{name}.toml").write_text(policy)
        proxy = ProxyProcess(
            *args,
            "--relay-key-file" if "--relay" in args else "--pp-key-file",
            str(self.home / "relay.key"),
            "--policy",
            str(self.home / f"{name}.toml"),
            "--host",
            self.hosts.address("proxy"),
            "--insecure-no-key",  # the switch is the test's own: only this process reaches it
            env={"ADAPTIVE_SPEC_STATE_DIR": str(self.home / name), "ADAPTIVE_SPEC_CONFIG_DIR": str(self.home / name)},
            host=self.hosts.address("proxy"),
            wrap=self.hosts.run("proxy"),
        )
        self.proxies.append(proxy)
        return proxy

    def stop(self) -> None:
        for proxy in self.proxies:
            proxy.stop()
        for relay in self.relays:
            relay.stop()
        for server in self.servers:
            server.stop()

    def left_over(self, i: int) -> list[str]:
        return sorted(p.name for p in self.slot_dirs[i].iterdir())


@pytest.fixture(scope="module")
def rig(llama_server_binary: str, tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    hosts = Hosts(["host0", "host1", "proxy"])
    try:
        made = Rig(hosts, llama_server_binary, tiny_gguf, tmp_path_factory.mktemp("hosts"))
        try:
            yield made
        finally:
            made.stop()
    finally:
        hosts.close()
        assert hosts.left() == []


def _body(messages: list[dict[str, str]], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": messages, "temperature": 0, "seed": 1, "max_tokens": max_tokens, **extra}


def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        assert resp.status == 200
        return json.loads(resp.read()), resp.headers.get("x-adaptive-spec-request-id", "")


def _turn(
    proxy: ProxyProcess, sid: str, messages: list[dict[str, str]], max_tokens: int, **extra: Any
) -> dict[str, Any]:
    reply, request_id = _post(
        proxy.base + "/v1/chat/completions", _body(messages, max_tokens, **extra), {"x-session-id": sid}
    )
    record = next(r for r in proxy.requests() if r["request_id"] == request_id)
    return {**record, "text": reply["choices"][0]["message"]["content"]}


def _history(sid: str) -> list[dict[str, str]]:
    facts = " ".join(f"item {i} of {sid} weighs {i * 3 % 17} kg." for i in range(40))
    return [{"role": "user", "content": f"Session {sid}. {facts} Which item is heaviest?"}]


def _overload_host0(rig: Rig, pool: ThreadPoolExecutor, loaders: list[str]) -> list[Future[Any]]:
    """Three long answers for sessions on host0, all in its slot BUSY_SLOT: by the router's count its slots are busy
    with one queued, while the moving session's own slot stays idle."""
    url = rig.pool.base + "/v1/chat/completions"
    futures = [
        pool.submit(
            _post, url, _body(_history(sid), LONG_TOKENS, id_slot=BUSY_SLOT, ignore_eos=True), {"x-session-id": sid}
        )
        for sid in loaders
    ]

    def in_flight() -> int:
        return int(http_json(rig.pool.base + "/adaptive/profiles")["profiles"][0]["replicas"][0]["in_flight"])

    wait_until(lambda: in_flight() >= len(loaders), 60, "the loading requests to reach the proxy")
    return futures


def _served_in_full(futures: list[Future[Any]]) -> None:
    for future in futures:
        reply, _ = future.result()
        assert reply["usage"]["completion_tokens"] == LONG_TOKENS, reply["usage"]


def _direct(server: LlamaServer, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """The same request straight to a server, prefilling everything (no cache reused)."""
    reply, _ = _post(server.url + "/v1/chat/completions", _body(messages, max_tokens, cache_prompt=False))
    return reply


def test_each_process_runs_on_its_own_host_and_the_pool_spans_two(rig: Rig) -> None:
    own = os.readlink("/proc/self/ns/net")
    pids = [s.pid for s in rig.servers] + [r.proc.pid for r in rig.relays] + [rig.pool.proc.pid]
    nets = [os.readlink(f"/proc/{pid}/ns/net") for pid in pids]
    assert own not in nets and nets[0] == nets[2] and nets[1] == nets[3] and len({nets[0], nets[1], nets[4]}) == 3
    replicas = http_json(rig.pool.base + "/adaptive/profiles")["profiles"][0]["replicas"]
    assert [(r["base_url"], r["up"]) for r in replicas] == [(s.url, True) for s in rig.servers], replicas
    # First turns, one at a time: least loaded first spreads them s, a, x, b, y, c, z → host0, host1, host0, ... (a
    # takes slot 0 of host1 as s does of host0, so that neither has more never used slots at a tie).
    placed = {}
    for sid in ("s", "a", "x", "b", "y", "c", "z"):
        slot = 0 if sid in ("s", "a") else BUSY_SLOT
        placed[sid] = _turn(rig.pool, sid, _history(sid), 8, id_slot=slot)["replica"]
    assert placed == {"s": 0, "a": 1, "x": 0, "b": 1, "y": 0, "c": 1, "z": 0}, placed


def test_a_session_moves_to_the_other_host_with_its_kv_through_the_relays(rig: Rig) -> None:
    messages = _history("s")
    with ThreadPoolExecutor(3) as pool:
        loaders = _overload_host0(rig, pool, ["x", "y", "z"])
        record = _turn(rig.pool, "s", messages, 16)
        _served_in_full(loaders)
    assert record["status"] == 200 and record["replica"] == 1, record["reason"]
    assert record["replica_moved_from"] == 0 and "hands its KV over" in record["reason"], record["reason"]
    handoff = record["handoff"]
    assert handoff["ok"] and handoff["bytes"] > 0 and handoff["tokens"] >= 300, handoff
    # The KV arrived on host1: only the prompt's tail is evaluated there.
    assert record["timings"]["cache_n"] >= handoff["tokens"] - 16 and record["timings"]["prompt_n"] < 16
    assert record["text"] == _direct(rig.servers[1], messages, 16)["choices"][0]["message"]["content"]
    assert rig.left_over(0) == [] and rig.left_over(1) == []
    print(
        f"\nrelay move between namespaces: {handoff['tokens']} tokens, {handoff['bytes']} bytes: save "
        f"{handoff['save_s'] * 1000:.1f} ms, transfer {handoff['transfer_s'] * 1000:.1f} ms, restore "
        f"{handoff['restore_s'] * 1000:.1f} ms; {record['reason']}"
    )


def _pull_the_cable_mid_move(rig: Rig) -> int:
    """Once the session's slot file is saved on host0 and on its way, host0's link goes down; the file's size."""

    def saved() -> list[Path]:
        return list(rig.slot_dirs[0].glob("as-*"))

    wait_until(lambda: bool(saved()), 120, "the move's slot file on host0")
    time.sleep(0.5)  # some of it crosses first
    size = saved()[0].stat().st_size
    rig.hosts.link_down("host0")
    return size


def test_host0s_link_down_mid_move_costs_a_re_prefill_and_no_failed_request(rig: Rig) -> None:
    assert _turn(rig.pool, "t", _history("t"), 8, id_slot=0)["replica"] == 0  # host1 holds more sessions now
    rig.hosts.rate_limit("host0", SLOW_LINK)  # after the proxy's probe: the router still prices a fast link
    try:
        with ThreadPoolExecutor(4) as pool:
            loaders = _overload_host0(rig, pool, ["x", "y", "z"])
            messages = _history("t")
            turn = pool.submit(_turn, rig.pool, "t", messages, 16)
            size = _pull_the_cable_mid_move(rig)
            record = turn.result()  # answered while host0 is still cut off
            assert rig.hosts.link_state("host0") == "DOWN"
            rig.hosts.link_up("host0")
            _served_in_full(loaders)  # the loaders on host0 resume once the link is back: every request a 200
    finally:
        rig.hosts.link_up("host0")
        rig.hosts.rate_limit("host0", None)
    assert record["status"] == 200 and record["replica"] == 1, record["reason"]
    handoff = record["handoff"]
    assert handoff is not None and not handoff["ok"] and rig.relays[0].base in handoff["error"], handoff
    across = re.search(r"(\d+) bytes", handoff["error"])
    assert across is not None and 0 < int(across.group(1)) < size, (handoff["error"], size)
    # The KV never arrived: host1 prefilled the prompt again, all but what its slot shared of it (the template's
    # opening). (Not compared with a direct answer's text: a prefill resumed after 13 tokens batches differently, and
    # the random-weight model's near-ties flip on that.)
    timings, whole = record["timings"], _direct(rig.servers[1], messages, 16)["timings"]["prompt_n"]
    assert timings["cache_n"] < 16 and timings["prompt_n"] + timings["cache_n"] == whole > 1000, timings
    print(f"\nlink down mid-move: {handoff['error']}; host1 prefilled {timings['prompt_n']}; {record['reason']}")


def test_a_long_prompt_is_prefilled_on_host1_and_decoded_on_host0(rig: Rig) -> None:
    proxy = rig.proxy(
        "pp",
        PP_POLICY,
        *("--profile", f"main={rig.servers[0].url}", "--slot-dir", str(rig.slot_dirs[0])),
        *("--pp-server", rig.relays[1].base, "--pp-min-tokens", "500", "--pp-prefill-tps", "5000"),
    )
    messages = [{"role": "user", "content": LONG}]
    record = _turn(proxy, "long", messages, 24)
    pp = record["remote_prefill"]
    assert pp is not None and pp["ok"], (record["reason"], pp, proxy.log()[-3000:])
    assert "remote prefill of" in record["reason"], record["reason"]
    # host0 reused what host1 prefilled: only the last token is evaluated again.
    assert record["timings"]["cache_n"] >= pp["tokens"] - 2 > 3000 and record["timings"]["prompt_n"] < 10
    assert record["text"] == _direct(rig.servers[0], messages, 24)["choices"][0]["message"]["content"]
    assert rig.left_over(1) == []
    print(f"\nremote prefill between namespaces: {json.dumps(pp)}")
