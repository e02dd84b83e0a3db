"""Two proxies sharing one real redis-server (`--shared-state`) while faults happen mid-run: the agent-like replays of
`benchmarks.shared_state.proxies` (four conversations side by side, each turn sent to a proxy drawn at random, the
slots of the two real tiny-model llama-servers erased before each replay) sent one replay after another, and in the
middle of it:

- no fault (the baseline, in the same run), and no fault through one proxy alone, with the store and without;
- Redis stopped for a while, then started again (empty: nothing is saved to disk);
- Redis flushed (FLUSHALL);
- one proxy killed (SIGKILL) in the middle of a stream: from a moment before, the replays go to the other proxy only
  (as a load balancer would send them), the dead proxy's booking lapses after the lease (`--shared-state-lease-s`,
  15 s by default);
- a head saved through one proxy while Redis is down, restored for a new session through the other once Redis is back
  (one llama-server with one slot, heads on; beside a round with Redis up throughout).

Run:  .venv/bin/python -m benchmarks.shared_state.faults [--before-s 5] [--down-s 5] [--after-s 10] [--repeats 1]

Per fault: the requests sent and failed, affinity (follow-ups whose prompt llama-server found in the slot: its
`cache_n` at least the previous turn's whole prompt) over the whole run, over the follow-ups sent after recovery and
over the last half of that,
the follow-ups' `prompt_n` median, the time per request (p50/p99), and how long until sharing resumed (both proxies'
`/adaptive/health` saying `shared_state.reachable` again, from Redis's start; for the killed proxy, until its
booking had lapsed in Redis). Each fault with a fresh pair of proxies and a Redis database of its own.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import signal
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import redis
from tests.support.processes.redis import RedisServer
from tests.support.processes.servers import LlamaServer, ProxyProcess, http_json

from adaptive_spec.bench import machine
from adaptive_spec.llama.binary.which import find_llama_server
from benchmarks.harness import RESULTS, results
from benchmarks.shared_state.heads import first_turn, system_prompt
from benchmarks.shared_state.proxies import Turn, erase, figures, post, tiny_servers

NAME = "shared_state_faults"
FAILURES = (OSError, http.client.HTTPException, ValueError, KeyError)  # every way a request can fail the client
Facts = dict[str, Any]


class Load:
    """Replays one after another until stopped, each turn sent to a proxy drawn from `targets` (a list replaced, never
    changed in place); a failed turn is counted and ends its conversation."""

    def __init__(self, proxies: list[ProxyProcess], servers: list[LlamaServer], args: argparse.Namespace, label: str):
        self.targets, self.servers, self.args, self.label = list(proxies), servers, args, label
        self.replays: list[list[list[Turn]]] = []
        self.failed: list[str] = []
        self._in_flight: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.started_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        seed = 0
        while not self._stop.is_set():
            seed += 1
            erase(self.servers)
            with ThreadPoolExecutor(self.args.conversations) as pool:
                work = pool.map(self._conversation, range(self.args.conversations), [seed] * self.args.conversations)
                self.replays.append(list(work))

    def _conversation(self, n: int, seed: int) -> list[Turn]:
        rng = random.Random(seed * 1000 + n)
        history: list[dict[str, str]] = [{"role": "user", "content": f"Conversation {n}: write a function number {n}."}]
        headers = {"x-session-id": f"{self.label}-{seed}-{n}"}
        out: list[Turn] = []
        for turn in range(self.args.turns):
            targets = self.targets
            proxy = targets[rng.randrange(len(targets))]
            body = {"model": "m", "messages": history, "temperature": 0, "seed": 1, "max_tokens": 24}
            with self._lock:
                self._in_flight[proxy.base] = self._in_flight.get(proxy.base, 0) + 1
            started = time.monotonic()
            try:
                answer, seconds = post(proxy, body, headers)
                timings = answer["timings"]
                text = answer["choices"][0]["message"]["content"]
            except FAILURES as exc:
                self.failed.append(f"{proxy.base} turn {turn}: {exc!r}")
                return out
            finally:
                with self._lock:
                    self._in_flight[proxy.base] -= 1
            out.append(Turn(started, seconds, int(timings["prompt_n"]), int(timings["cache_n"]), proxy.base))
            history = [
                *history,
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"Now step {turn}."},
            ]
        return out

    def in_flight(self, proxy: ProxyProcess) -> int:
        with self._lock:
            return self._in_flight.get(proxy.base, 0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(300)


def _shared(proxy: ProxyProcess) -> dict[str, Any]:
    return dict(http_json(proxy.base + "/adaptive/health", timeout=10)["shared_state"])


def _reachable(proxy: ProxyProcess) -> bool:
    return bool(_shared(proxy)["reachable"])


def _seconds_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> float | None:
    """Seconds until `predicate` held (polled), or None if it did not within `timeout_s`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if predicate():
            return round(time.monotonic() - started, 2)
        time.sleep(interval_s)
    return None


def _booked(client: redis.Redis) -> list[str]:
    """Every booking whose lease has not ended (on Redis's clock), as its member (slot|proxy|request|session)."""
    seconds, micros = client.time()
    now_ms = seconds * 1000 + micros // 1000
    keys = [str(k) for k in list(client.keys("adaptive-spec:booked:*"))]
    return [str(m) for k in keys for m in list(client.zrangebyscore(k, now_ms, "+inf"))]


# --- the faults: each runs while the load does, and returns when the fault is over (`recovered_at`: from when) ----


def no_fault(
    pair: list[ProxyProcess], redis_server: RedisServer, db: str, load: Load, args: argparse.Namespace
) -> Facts:
    time.sleep(args.down_s)
    return {"recovered_at": time.monotonic(), "resumed_s": None}


def redis_stopped(
    pair: list[ProxyProcess], redis_server: RedisServer, db: str, load: Load, args: argparse.Namespace
) -> Facts:
    redis_server.stop()
    stopped = time.monotonic()
    noticed = _seconds_until(lambda: not any(_reachable(p) for p in pair), args.down_s)
    time.sleep(max(0.0, args.down_s - (time.monotonic() - stopped)))
    redis_server.start()
    started = time.monotonic()
    resumed = _seconds_until(lambda: all(_reachable(p) for p in pair), 60)
    return {
        "recovered_at": time.monotonic(),
        "noticed_s": noticed,
        "down_s": round(started - stopped, 2),
        "resumed_s": resumed,
    }


def redis_flushed(
    pair: list[ProxyProcess], redis_server: RedisServer, db: str, load: Load, args: argparse.Namespace
) -> Facts:
    redis_server.client().flushall()
    flushed = time.monotonic()
    unreachable = 0
    while time.monotonic() - flushed < args.down_s:  # whether either proxy ever says Redis is gone
        unreachable += sum(not _reachable(p) for p in pair)
        time.sleep(0.1)
    return {"recovered_at": flushed, "said_unreachable": unreachable, "resumed_s": 0.0 if not unreachable else None}


def proxy_killed(
    pair: list[ProxyProcess], redis_server: RedisServer, db: str, load: Load, args: argparse.Namespace
) -> Facts:
    doomed, survivor = pair
    doomed_id = _shared(doomed)["proxy"]
    load.targets = [survivor]  # the replays go to the survivor from now on; the doomed one's turns end first
    _seconds_until(lambda: load.in_flight(doomed) == 0, 60)
    body = {"model": "m", "messages": [{"role": "user", "content": "A long answer, please."}], "stream": True}
    body |= {"max_tokens": 1500, "temperature": 0, "ignore_eos": True}
    req = urllib.request.Request(
        doomed.base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "x-session-id": "killed-mid-stream"},
    )
    client = redis.Redis.from_url(db, decode_responses=True)
    resp = urllib.request.urlopen(req, timeout=120)
    assert resp.readline().startswith(b"data: ")
    booked = _seconds_until(lambda: any(f"|{doomed_id}|" in m for m in _booked(client)), 30)
    doomed.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    doomed.proc.wait(30)
    held = any(f"|{doomed_id}|" in m for m in _booked(client))
    try:
        rest = resp.read()
    except (http.client.IncompleteRead, ConnectionError) as exc:
        rest = getattr(exc, "partial", b"")
    lapsed = _seconds_until(lambda: not any(f"|{doomed_id}|" in m for m in _booked(client)), 120)
    return {
        "recovered_at": time.monotonic(),
        "booked_before_kill": booked is not None,
        "booking_held_at_kill": held,
        "stream_ended_without_done": b"[DONE]" not in rest,
        "lapsed_s": lapsed,
        "resumed_s": lapsed,
        "survivor_reachable": _reachable(survivor),
        "killed_after_s": round(killed - load.started_at, 2),
    }


Fault = Callable[[list[ProxyProcess], RedisServer, str, Load, argparse.Namespace], Facts]
# name: (proxies, whether they share Redis, the fault). One proxy alone, with and without the store, beside the pair:
# what the shared state costs by itself.
FAULTS: dict[str, tuple[int, bool, Fault]] = {
    "no fault, one proxy, no Redis": (1, False, no_fault),
    "no fault, one proxy, Redis": (1, True, no_fault),
    "no fault": (2, True, no_fault),
    "Redis stopped, then started": (2, True, redis_stopped),
    "Redis flushed": (2, True, redis_flushed),
    "a proxy killed mid-stream": (2, True, proxy_killed),
}


def _fault_run(
    name: str,
    label: str,
    servers: list[LlamaServer],
    redis_server: RedisServer,
    db: str,
    home: Path,
    args: argparse.Namespace,
) -> tuple[list[list[list[Turn]]], list[str], Facts]:
    count, shared, fault = FAULTS[name]
    profile = [a for s in servers for a in ("--profile", f"plain={s.url}")]
    pair = [
        ProxyProcess(
            *profile,
            *("--tokenizer", "off", "--no-heads"),
            *(("--shared-state", db) if shared else ()),
            env={
                "ADAPTIVE_SPEC_STATE_DIR": str(home / f"{label}-{i}"),
                "ADAPTIVE_SPEC_CONFIG_DIR": str(home / f"{label}-{i}"),
            },
        )
        for i in range(count)
    ]
    try:
        warm = Load(pair, servers, args, f"warm{label}")  # connections, first runs of the code
        time.sleep(1.0)
        warm.stop()
        load = Load(pair, servers, args, f"run{label}")
        time.sleep(args.before_s)
        facts = fault(pair, redis_server, db, load, args)
        time.sleep(args.after_s)
        load.stop()
    finally:
        for proxy in pair:
            proxy.stop()
    return load.replays, load.failed, facts


def _heads(proxy: ProxyProcess) -> set[str]:
    return {str(h["id"]) for h in http_json(proxy.base + "/adaptive/heads", timeout=30)["heads"]}


def _settled(a: ProxyProcess, b: ProxyProcess) -> bool:
    """No save under way in either head store, and both list the same heads."""
    shown = [http_json(p.base + "/adaptive/heads", timeout=30) for p in (a, b)]
    return not any(s["pending"] for s in shown) and len({frozenset(h["id"] for h in s["heads"]) for s in shown}) == 1


def _poke(proxy: ProxyProcess, n: int) -> None:
    """A short request of a session of its own: the proxy calls the store (how it finds Redis gone, or back)."""
    body = {"model": "m", "messages": [{"role": "user", "content": f"poke {n}"}], "max_tokens": 2}
    post(proxy, body, {"x-session-id": f"poke-{n}"})


def _head_round(a: ProxyProcess, b: ProxyProcess, redis_server: RedisServer, round_: int, down: bool) -> Facts:
    """A new system prompt's first turn through a (a saves its head), with Redis down meanwhile or not; then how long
    until b lists that head, and a new session's first turn through b (the slot erased through a: both know)."""
    # The last round's heads settled first: b's own save of its cold session, and a taking it from b, would otherwise
    # be counted as a's new head here.
    _seconds_until(lambda: _settled(a, b), 10)
    system, before = system_prompt(1000 + round_), _heads(a)
    if down:
        redis_server.stop()
    cold = first_turn(a, system, f"cold-{round_}")
    back = time.monotonic()  # a's answer; with Redis down at the save, Redis's start
    # While Redis is down a proxy saves no head (its guards cannot count the others' requests): none may come.
    saved_s = _seconds_until(lambda: len(_heads(a) - before) == 1, 60 if not down else 5)
    head = next(iter(_heads(a) - before), None)
    facts: Facts = {"redis_down_at_save": down, "a_reachable_at_save": _reachable(a), "saved_s": saved_s}
    if down:
        redis_server.start()
        back, pokes = time.monotonic(), iter(range(10**6))

        def both_reachable() -> bool:
            for proxy in (a, b):
                _poke(proxy, next(pokes) + round_ * 10**6)
            return all(_reachable(p) for p in (a, b))

        facts["resumed_s"] = _seconds_until(both_reachable, 60, interval_s=0.5)
    listed = None if head is None else _seconds_until(lambda: head in _heads(b), 30, interval_s=0.1)
    facts["listed_by_b_s"] = None if listed is None else round(time.monotonic() - back, 2)
    http_json(a.base + "/adaptive/profiles/plain/erase", {})
    other = first_turn(b, system, f"other-{round_}")
    http_json(a.base + "/adaptive/profiles/plain/erase", {})
    return facts | {"cold": cold, "through b": other}


def _head_runs(home: Path, model: Path, redis_server: RedisServer, db: str, rounds: int) -> list[Facts]:
    (home / "slots").mkdir(parents=True)
    # No RAM prompt cache: a prefix the new session finds is the head's (llama-server's own cache kept it otherwise).
    server_args = ("-c", "8192", "--parallel", "1", "--spec-type", "none", "--cache-ram", "0", "--slot-save-path")
    server = LlamaServer(find_llama_server(None), model, *server_args, str(home / "slots"), log_dir=home)
    proxies: list[ProxyProcess] = []
    try:
        for name in ("a", "b"):
            env = {"ADAPTIVE_SPEC_STATE_DIR": str(home / name), "ADAPTIVE_SPEC_CONFIG_DIR": str(home / name)}
            args_ = ("--profile", f"plain={server.url}", "--slot-dir", str(home / "slots"), "--shared-state", db)
            proxies.append(ProxyProcess(*args_, env=env))
        a, b = proxies
        return [_head_round(a, b, redis_server, r, down=r % 2 == 1) for r in range(2 * rounds)]
    finally:
        for proxy in proxies:
            proxy.stop()
        server.stop()


def _row(replays: list[list[list[Turn]]], failed: list[str], facts: list[Facts], after_s: float) -> Facts:
    after = [figures(replays, since=f["recovered_at"]) for f in facts]
    settled = [figures(replays, since=f["recovered_at"] + after_s / 2) for f in facts]
    return {
        **figures(replays),
        "failed": len(failed),
        "failures": failed[:10],
        "affinity_after_recovery": [f["affinity"] for f in after],
        "affinity_last_half_after": [f["affinity"] for f in settled],
        "faults": [{k: v for k, v in f.items() if k != "recovered_at"} for f in facts],
    }


def _print_table(out: dict[str, Facts], heads: list[Facts]) -> None:
    print(
        "\n| fault | requests (failed) | affinity | after recovery (its last half) | follow-up `prompt_n` median "
        "| p50 / p99 ms | sharing resumed after |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, f in out.items():
        pairs = zip(f["affinity_after_recovery"], f["affinity_last_half_after"], strict=True)
        after = ", ".join(f"{a:.1%} ({b:.1%})" for a, b in pairs if a is not None and b is not None)
        resumed = ", ".join("—" if x.get("resumed_s") is None else f"{x['resumed_s']} s" for x in f["faults"])
        print(
            f"| {name} | {f['requests']} ({f['failed']}) | {f['affinity']:.1%} "
            f"| {after} "
            f"| {f['follow_up_prompt_n_median']} | {f['ms_p50']} / {f['ms_p99']} | {resumed} |"
        )
    print("\n| head saved | b listed it after | b's new session: `prompt_n` / `cache_n` | restored | ms |")
    print("|---|---|---|---|---|")
    for h in heads:
        said = "with Redis down" if h["redis_down_at_save"] else "with Redis up"
        other = h["through b"]
        listed = f"{h['listed_by_b_s']} s" if h["listed_by_b_s"] is not None else "never (30 s)"
        listed = listed if h["saved_s"] is not None else "none saved"
        print(f"| {said} | {listed} | {other['prompt_n']} / {other['cache_n']} | {other['restored']} | {other['ms']} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=4, help="side by side (4: one slot each)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--before-s", type=float, default=5.0, help="load before each fault")
    parser.add_argument("--down-s", type=float, default=5.0, help="how long Redis stays down")
    parser.add_argument("--after-s", type=float, default=10.0, help="load after each fault is over")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each fault (each with fresh proxies)")
    parser.add_argument("--out", type=Path, default=RESULTS / "shared_state_faults.json")
    args = parser.parse_args()
    started = machine.sample()
    binary = find_llama_server(None)
    out: dict[str, Facts] = {}
    with tempfile.TemporaryDirectory(prefix="shared-faults-bench-") as tmp:
        home = Path(tmp)
        servers = tiny_servers(home, binary)
        redis_server = RedisServer(home)
        base = redis_server.url.rsplit("/", 1)[0]
        try:
            runs: dict[str, tuple[list[list[list[Turn]]], list[str], list[Facts]]] = {n: ([], [], []) for n in FAULTS}
            for r in range(
                args.repeats
            ):  # the faults in turn, repeat by repeat: the machine's load falls on each alike
                for i, name in enumerate(FAULTS):
                    label = f"{r}-{i}"
                    replays, failed, facts = _fault_run(
                        name, label, servers, redis_server, f"{base}/{i + 1}", home, args
                    )
                    runs[name][0].extend(replays)
                    runs[name][1].extend(failed)
                    runs[name][2].append(facts)
                    print(name, facts, f"{len(failed)} failed", flush=True)
            for name, (replays, failed, kept) in runs.items():
                out[name] = _row(replays, failed, kept, args.after_s)
            heads = _head_runs(home / "heads", home / "tiny.gguf", redis_server, f"{base}/9", args.repeats)
        finally:
            redis_server.stop()
            for server in servers:
                server.stop()
    _print_table(out, heads)
    figures_ = {"faults": out, "heads": heads, "args": vars(args)}
    print(f"written to {results.write(args.out, NAME, figures_, started=started)}")


if __name__ == "__main__":
    main()
