"""Two `serve` processes sharing one real redis-server (`--shared-state`), in front of two real llama-servers (the
tiny random-weight model, two slots each): agent conversations replayed with each turn sent to a proxy at random
land where their KV is, with the same `prompt_n` on every turn as through one proxy (two sessions given one slot at
once would evict each other: their next turns would re-prefill); without the shared state they do not. Then the
faults: Redis stopped, restarted and flushed under load (every request served, said once, sharing resumes; an idle
proxy finds it back by itself), and a proxy killed mid-stream (its bookings lapse, the other serves on); and the URL
given in the policy file."""

from __future__ import annotations

import http.client
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.support.processes.redis import RedisServer
from tests.support.processes.servers import LlamaServer, ProxyProcess, http_json, wait_until

SERVER_ARGS = ("-c", "4096", "--parallel", "2", "--spec-type", "none", "--cache-ram", "0")
SESSIONS = 4  # one slot each: 2 servers x 2 slots
TURNS = 3


@pytest.fixture(scope="module")
def servers(
    llama_server_binary: str, tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[LlamaServer]]:
    logs = tmp_path_factory.mktemp("shared-state-logs")
    # Each its own slot directory (as on two hosts): slot actions (the erase between replays) work, no KV moves.
    dirs = [tmp_path_factory.mktemp(f"slots{i}") for i in range(2)]
    started = [
        LlamaServer(llama_server_binary, tiny_gguf, *SERVER_ARGS, "--slot-save-path", str(d), log_dir=logs)
        for d in dirs
    ]
    yield started
    for server in started:
        server.stop()


def _proxies(servers: list[LlamaServer], home: Path, count: int, *extra: str) -> list[ProxyProcess]:
    args = [a for s in servers for a in ("--profile", f"plain={s.url}")]
    out = []
    for i in range(count):
        env = {"ADAPTIVE_SPEC_STATE_DIR": str(home / f"state{i}"), "ADAPTIVE_SPEC_CONFIG_DIR": str(home / f"config{i}")}
        out.append(ProxyProcess(*args, "--tokenizer", "off", "--no-heads", *extra, env=env))
    return out


def _erase(servers: list[LlamaServer]) -> None:
    """Every slot emptied: each replay starts from cold servers."""
    for server in servers:
        for slot in range(2):
            http_json(f"{server.url}/slots/{slot}?action=erase", {})


def _post(proxy: ProxyProcess, body: dict[str, Any], headers: dict[str, str]) -> tuple[dict[str, Any], str]:
    req = urllib.request.Request(
        proxy.base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            assert resp.status == 200
            return json.loads(resp.read()), resp.headers["x-adaptive-spec-request-id"]
    except urllib.error.HTTPError as exc:  # what the proxy said, and its log's end, in the failure
        said = exc.read()[:2000].decode(errors="replace")
        raise AssertionError(f"{exc.code}: {said}\n" + "\n".join(proxy.stderr_lines[-30:])) from exc


def _conversation(proxies: list[ProxyProcess], n: int, seed: int) -> list[tuple[ProxyProcess, str]]:
    """One agent's conversation, each turn sent to a proxy drawn at random, naming its session (a session header:
    the tiny model's replies are too alike to find sessions by the reply they carry back; that part is
    tests/unit/shared_state's)."""
    rng = random.Random(seed * 100 + n)
    history: list[dict[str, str]] = [{"role": "user", "content": f"Conversation {n}: write a function number {n}."}]
    headers = {"x-session-id": f"conv-{n}"}
    sent = []
    for turn in range(TURNS):
        proxy = rng.choice(proxies)
        body = {"model": "m", "messages": history, "temperature": 0, "seed": 1, "max_tokens": 24}
        reply, request_id = _post(proxy, body, headers)
        sent.append((proxy, request_id))
        text = reply["choices"][0]["message"]["content"]
        history = [*history, {"role": "assistant", "content": text}, {"role": "user", "content": f"Now step {turn}."}]
    return sent


def _replay(proxies: list[ProxyProcess], seed: int = 1) -> list[list[dict[str, Any]]]:
    """The conversations side by side (each its own thread); each turn's record, read from the proxy that served it."""
    with ThreadPoolExecutor(SESSIONS) as pool:
        sent = list(pool.map(lambda n: _conversation(proxies, n, seed), range(SESSIONS)))
    records = {p.base: {r["request_id"]: r for r in p.requests()} for p in proxies}
    return [[records[p.base][rid] | {"via": p.base} for p, rid in turns] for turns in sent]


def _prompt_n(replayed: list[list[dict[str, Any]]]) -> list[list[int]]:
    return [[r["timings"]["prompt_n"] for r in turns] for turns in replayed]


class SlotWatch:
    """Reads every live booking in Redis, over and over while a replay runs, and keeps each moment two sessions held
    one slot of one server at once (what would make them evict each other's KV)."""

    def __init__(self, redis_server: RedisServer) -> None:
        self.client = redis.Redis.from_url(redis_server.url, decode_responses=True)
        self.reads, self.shared_slots = 0, list[str]()
        # Each booking as first read: when (Redis's clock, s), the server's port and slot, the session.
        self.seen: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            seconds, micros = self.client.time()
            now_ms = seconds * 1000 + micros // 1000
            for key in [str(k) for k in list(self.client.keys("adaptive-spec:booked:*"))]:
                held: dict[str, set[str]] = {}
                for member in list(self.client.zrangebyscore(key, now_ms, "+inf")):
                    slot, _proxy, _request, session = str(member).split("|", 3)
                    self.seen.setdefault(
                        key + str(member), f"{now_ms % 100_000 / 1000:.3f} {key[-5:]}/{slot} {session}"
                    )
                    if int(slot) >= 0:
                        held.setdefault(slot, set()).add(session)
                self.shared_slots += [f"{key} slot {s}: {sorted(v)}" for s, v in held.items() if len(v) > 1]
            self.reads += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)


@pytest.mark.parametrize("count", [2, 3])
def test_turns_sent_to_any_proxy_land_where_their_kv_is(
    servers: list[LlamaServer], redis_server: RedisServer, tmp_path: Path, count: int
) -> None:
    _erase(servers)
    (one,) = _proxies(servers, tmp_path / "one", 1)
    try:
        alone = _replay([one])
    finally:
        one.stop()
    _erase(servers)
    proxies = _proxies(servers, tmp_path / "many", count, "--shared-state", redis_server.url)
    watch = SlotWatch(redis_server)
    try:
        shared = _replay(proxies)
        health = [http_json(p.base + "/adaptive/health")["shared_state"] for p in proxies]
    finally:
        watch.stop()
        for proxy in proxies:
            proxy.stop()
    assert all(h["reachable"] for h in health), health
    booked = sorted(watch.seen.values()) + [line for p in proxies for line in p.stderr_lines if "shared state" in line]
    assert watch.reads > 10 and watch.shared_slots == [], (  # never two sessions in one slot
        str(sorted(set(watch.shared_slots))) + _where(shared, booked)
    )
    assert {r["replica"] for turns in shared for r in turns} == {0, 1}  # both servers served
    crossed = sum(a["via"] != b["via"] for turns in shared for a, b in itertools.pairwise(turns))
    assert crossed > 0  # follow-ups reached another proxy than their previous turn's (the seeds make sure)
    for turns in shared:
        assert len({r["session_id"] for r in turns}) == 1, [(r["session_id"], r["session_source"]) for r in turns]
        assert len({r["replica"] for r in turns}) == 1, [(r["replica"], r["reason"]) for r in turns]
        assert all(r["timings"]["cache_n"] > 0 for r in turns[1:]), _where(shared, booked)
    assert _prompt_n(shared) == _prompt_n(alone), _where(shared, booked)


def _where(replayed: list[list[dict[str, Any]]], booked: list[str]) -> str:
    """Each turn's session, proxy (its port), server, cached and new tokens, when it started (s), how long it took
    (ms) and why it went there, then each booking as the watch first read it: what a failed check shows, whole."""
    turns = [
        f"{r['session_id']} via {r['via'][-5:]} on {r['replica']}: cache_n {r['timings']['cache_n']} prompt_n "
        f"{r['timings']['prompt_n']} at {r['started_at_unix'] % 100:.3f} for {r['total_ms']:.0f} ms: {r['reason']}"
        for t in replayed
        for r in t
    ]
    return "\n".join(["", *turns, "bookings:", *booked])


def test_without_the_shared_state_turns_lose_their_kv(servers: list[LlamaServer], tmp_path: Path) -> None:
    """The same replay through two proxies that share nothing: some follow-up re-prefills (what the test above
    would see without `--shared-state`)."""
    _erase(servers)
    (one,) = _proxies(servers, tmp_path / "one", 1)
    try:
        alone = _replay([one])
    finally:
        one.stop()
    _erase(servers)
    pair = _proxies(servers, tmp_path / "pair", 2)
    try:
        blind = _replay(pair)
    finally:
        for proxy in pair:
            proxy.stop()
    assert _prompt_n(blind) != _prompt_n(alone)


def _health(proxy: ProxyProcess) -> dict[str, Any]:
    return dict(http_json(proxy.base + "/adaptive/health")["shared_state"])


class Load:
    """Conversations sent to both proxies at random, one after another, until stopped; every answer must be a 200."""

    def __init__(self, proxies: list[ProxyProcess]) -> None:
        self.proxies, self.done = proxies, 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        rng, n = random.Random(7), 0
        while not self._stop.is_set():
            n += 1
            history = [{"role": "user", "content": f"Load conversation {n}: say something."}]
            for turn in range(2):
                body = {"model": "m", "messages": history, "temperature": 0, "max_tokens": 8}
                try:
                    reply, _ = _post(rng.choice(self.proxies), body, {"x-session-id": f"load-{n}"})
                except Exception as exc:  # every kind of failure is what this load counts
                    self.failures.append(repr(exc))
                    continue
                self.done += 1
                text = reply["choices"][0]["message"]["content"]
                history += [{"role": "assistant", "content": text}, {"role": "user", "content": f"More {turn}."}]

    def served_more(self, than: int) -> bool:
        return self.done > than

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)


def test_redis_stopped_restarted_and_flushed_under_load(
    servers: list[LlamaServer], redis_server: RedisServer, tmp_path: Path
) -> None:
    pair = _proxies(servers, tmp_path, 2, "--shared-state", redis_server.url)
    load = Load(pair)
    try:
        wait_until(lambda: load.served_more(10), 60, "the load's first answers")
        redis_server.stop()
        wait_until(lambda: not any(_health(p)["reachable"] for p in pair), 60, "both proxies to see Redis gone")
        down = _health(pair[0])
        assert any("slot bookings" in w for w in down["weakened"]) and down["error"], down
        served = load.done
        wait_until(lambda: load.served_more(served + 10), 60, "answers while Redis is down")
        redis_server.start()
        wait_until(lambda: all(_health(p)["reachable"] for p in pair), 60, "both proxies to use Redis again")
        served = load.done
        wait_until(lambda: load.served_more(served + 5), 60, "answers once Redis is back")
        redis_server.client().flushall()
        served = load.done
        wait_until(lambda: load.served_more(served + 10), 60, "answers after the flush")
    finally:
        load.stop()
    try:
        assert load.failures == []
        for proxy in pair:
            said = [line for line in proxy.stderr_lines if "cannot be reached" in line]
            assert len(said) == 1, said  # said once, not per request
            assert any("answers again" in line for line in proxy.stderr_lines)
        # Sharing resumed: a conversation begun on one proxy continues on the other where its KV is.
        first, second = pair
        messages: list[dict[str, Any]] = [{"role": "user", "content": "After the outage: hello there."}]
        body = {"model": "m", "messages": messages, "max_tokens": 8}
        reply, rid = _post(first, body, {"x-session-id": "after"})
        messages += [reply["choices"][0]["message"], {"role": "user", "content": "And again."}]
        _, rid2 = _post(second, body, {"x-session-id": "after"})
        one = next(r for r in first.requests() if r["request_id"] == rid)
        two = next(r for r in second.requests() if r["request_id"] == rid2)
        assert two["replica"] == one["replica"] and two["timings"]["cache_n"] > 0, (one["reason"], two["reason"])
    finally:
        for proxy in pair:
            proxy.stop()


def test_an_idle_proxy_finds_the_store_back_without_a_request(
    servers: list[LlamaServer], redis_server: RedisServer, tmp_path: Path
) -> None:
    """Its listener connecting again is the store answering: /adaptive/health says so (and what was kept back while
    it was down is written) with no request to find it, not only once the next request calls the store."""
    (proxy,) = _proxies(servers, tmp_path, 1, "--shared-state", redis_server.url)
    try:
        redis_server.stop()
        body = {"model": "m", "messages": [{"role": "user", "content": "While Redis is away."}], "max_tokens": 4}
        _post(proxy, body, {"x-session-id": "away"})
        assert _health(proxy)["reachable"] is False
        redis_server.start()
        wait_until(lambda: _health(proxy)["reachable"], 15, "the idle proxy to say Redis answers again")
        assert sum("answers again" in line for line in proxy.stderr_lines) == 1
    finally:
        proxy.stop()


def _booked(redis_server: RedisServer) -> list[str]:
    """Every booking whose lease has not ended (on Redis's clock), as its member (slot|proxy|request|session)."""
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    seconds, micros = client.time()
    now_ms = seconds * 1000 + micros // 1000
    keys = [str(k) for k in list(client.keys("adaptive-spec:booked:*"))]
    return [str(m) for k in keys for m in list(client.zrangebyscore(k, now_ms, "+inf"))]


def test_a_proxy_killed_mid_stream_its_bookings_lapse_the_other_serves_on(
    servers: list[LlamaServer], redis_server: RedisServer, tmp_path: Path
) -> None:
    """The tiny model answers a whole stream in milliseconds, faster than a test can kill a proxy in its middle: both
    servers are paused (SIGSTOP) before the request, so its stream is surely running (booked, its headers and
    keep-alives out) and unfinished when its proxy dies."""
    extra = ("--shared-state", redis_server.url, "--shared-state-lease-s", "2", "--prefill-keepalive", "0.2")
    pair = _proxies(servers, tmp_path, 2, *extra)
    doomed, survivor = pair
    try:
        doomed_id = _health(doomed)["proxy"]
        body = {"model": "m", "messages": [{"role": "user", "content": "A long answer, please."}], "stream": True}
        body |= {"max_tokens": 64, "temperature": 0}
        req = urllib.request.Request(
            doomed.base + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        for server in servers:
            os.kill(server.pid, signal.SIGSTOP)
        try:
            resp = urllib.request.urlopen(req, timeout=120)
            assert resp.readline().startswith(b"data: ")  # streaming (a keep-alive: the server is paused)
            wait_until(lambda: any(f"|{doomed_id}|" in m for m in _booked(redis_server)), 30, "its booking")
            doomed.proc.send_signal(signal.SIGKILL)
            doomed.proc.wait(30)
        finally:
            for server in servers:
                os.kill(server.pid, signal.SIGCONT)
        assert any(f"|{doomed_id}|" in m for m in _booked(redis_server))  # it died holding its slot
        try:  # its stream ends, without the end marker
            rest = resp.read()
        except (http.client.IncompleteRead, ConnectionError) as exc:
            rest = getattr(exc, "partial", b"")
        assert b"[DONE]" not in rest
        wait_until(
            lambda: not any(f"|{doomed_id}|" in m for m in _booked(redis_server)),
            30,
            "the dead proxy's booking to lapse",
        )
        for n in range(6):  # the survivor serves on, over both servers' slots
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": f"Survivor {n}: hi there."}],
                "max_tokens": 8,
            }
            _post(survivor, body, {"x-session-id": f"after-{n}"})
        assert _health(survivor)["reachable"]
    finally:
        for proxy in pair:
            proxy.stop()


def test_the_policy_file_names_the_shared_state(
    servers: list[LlamaServer], redis_server: RedisServer, tmp_path: Path
) -> None:
    """`[shared_state] url` in the proxy's own policy file, instead of `--shared-state`; a bad one stops `serve` at
    start, naming the file, the key and the line."""
    policy = tmp_path / "policy.toml"
    policy.write_text(f'[shared_state]\nlease_s = 9\nurl = "{redis_server.url}"\n')
    proxies = _proxies(servers, tmp_path, 2, "--policy", str(policy))
    try:
        _post(proxies[0], {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, {})
        health = [http_json(p.base + "/adaptive/health")["shared_state"] for p in proxies]
        assert [(h["store"], h["reachable"]) for h in health] == [(redis_server.url, True)] * 2, health
        assert any(
            "from the policy's [shared_state]" in line for line in proxies[0].stderr_lines + proxies[0].stdout_lines
        )
        assert _booked(redis_server) == [] and redis_server.client().keys("adaptive-spec:place:*")
    finally:
        for proxy in proxies:
            proxy.stop()
    policy.write_text('[shared_state]\nurl = "http://10.0.0.9:6379"\n')
    argv = [sys.executable, "-m", "adaptive_spec", "serve", "--policy", str(policy), "--port", "0"]
    done = subprocess.run([*argv, "--profile", f"plain={servers[0].url}"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert f"{policy}:shared_state.url:2: 'http' is not a Redis URL" in done.stderr, done.stderr
