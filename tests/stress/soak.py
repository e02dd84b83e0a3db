"""A day of traffic, compressed: `adaptive-spec serve` (its own process, loopback only) on two launched profiles (the
tiny random-weight model, -t 1, --parallel 4) for `--minutes`, with `--streams` clients sending one request after
another (a think time between them, `--think-s`) over every API the proxy speaks (chat/completions streamed and not,
completions, Responses, Anthropic Messages), every other one a new agent session in a recorded agent's shape opening
with one of a few long synthetic heads (`soak_agents.py`), a share of them hanging up mid-answer, the profiles'
llama-server killed (SIGKILL) every `--kill-every` seconds (the launcher restarts it), the policy file edited every
`--edit-every` seconds (its [route] and [heads] tables), and the head store bounded small (`--heads-max-gb`) so
that heads are saved, restored (into new sessions, and into the restarted server) and evicted all along.

It checks what a day of use must leave true and writes the figures:
- no error other than the expected ones: a request that fails is expected only while its server was down (from a
  kill until the launcher has it back, plus a grace) or when the client hung up itself;
- every request the proxy answered is recorded exactly once (the trace, by request id);
- the proxy's resident memory, open descriptors, threads and asyncio tasks (its /metrics gauge), sampled every
  `--sample-every` seconds, stay flat: resident memory over the last third of the run within RSS_SLACK_KIB (a
  leak goes on growing; the growth from the first sample after warm-up is reported beside it: at 64 streams the
  allocator's high-water mark took ~45 minutes to settle, 11 MiB, while the Python heap stayed within 0.4 MiB);
  descriptors, threads and tasks with the proxy idle, before the clients start and once they have stopped (while
  streams run they follow the requests in flight, not what is left behind);
- at the end nothing is left in flight in the router;
- the head store's bytes (`GET /adaptive/heads`, and the head files on disk) within its bound at every sample, and
  heads saved, restored and evicted during the run (its counts by outcome are reported).

Run (from the repository root, on demand, not in CI):
  python -m tests.stress.soak --minutes 60 --streams 16 --kill-every 240 --out soak.json
  python -m tests.stress.soak --minutes 3 --streams 16 --kill-every 60 --edit-every 45   # a short look
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from tests.stress.load import trace_check
from tests.stress.rig import process_figures, write_figures
from tests.stress.soak_agents import load_shapes, session_turns, store_sample
from tests.support.models.tiny_gguf import write_tiny_gguf
from tests.support.processes.servers import ProxyProcess, http_json, http_text

REQUEST_TIMEOUT_S = 120.0
DOWN_GRACE_S = 10.0  # after the launcher has a killed server back, requests already failing may still end
HANG_UP_SHARE = 0.1
IDLE_S = 6.0  # after the last client: the proxy's idle upstream connections are gone (kept 2 s, swept every 2 s)
# The reply echo's bound for the soak: full within the first minute. At the default (200,000 replies and as many
# lines, ~70 MiB) it fills for ~40 minutes at 64 streams, growth that a shorter run could not tell from a leak.
ECHO_FINGERPRINTS = 2048
RSS_SLACK_KIB = 2048  # over the run's last third, growth beyond this is memory kept
# 4 slots of 4,096 tokens: an agent head (~2,400 tokens on the tiny model) with the shape's tools and the reply fits
CTX_SIZE = 16384
# The head store's bound: ~1.2 MiB a head file on the tiny model (512 bytes of KV a token), so ~5 of the soak's heads
HEADS_MAX_GB = 0.006
MIN_TOKENS = (256, 128, 1024)  # the policy edits cycle the [heads] table's min_tokens through these
_TASKS = re.compile(r"^adaptive_spec_event_loop_tasks (\S+)$", re.MULTILINE)
APIS = ("chat-stream", "chat", "completions", "responses", "messages")
MESSAGES = [{"role": "user", "content": "Say something about the sea."}]


@dataclass
class Outcome:
    api: str
    status: int
    ok: bool
    hung_up: bool
    request_id: str | None
    started: float
    ended: float
    error: str | None = None


@dataclass
class Soak:
    outcomes: list[Outcome] = field(default_factory=list)
    down: list[list[float]] = field(default_factory=list)  # [killed at, back at] (monotonic)
    samples: list[dict[str, Any]] = field(default_factory=list)
    idle: list[dict[str, Any]] = field(default_factory=list)  # before the clients start, and after they stopped
    edits: int = 0
    heads_dir: Path = Path()

    def expected_failure(self, o: Outcome) -> bool:
        return o.hung_up or any(start <= o.ended and o.started <= end + DOWN_GRACE_S for start, end in self.down)


def _request(api: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
    if api in ("chat-stream", "chat"):
        body = {"model": "m", "messages": MESSAGES, "max_tokens": max_tokens, "stream": api == "chat-stream"}
        return "/v1/chat/completions", body
    if api == "completions":
        return "/v1/completions", {"model": "m", "prompt": "The sea is", "max_tokens": max_tokens}
    if api == "responses":
        return "/v1/responses", {"model": "m", "input": MESSAGES[0]["content"], "max_output_tokens": max_tokens}
    return "/v1/messages", {"model": "m", "messages": MESSAGES, "max_tokens": max_tokens}


async def _one(
    session: aiohttp.ClientSession, base: str, api: str, request: tuple[str, dict[str, Any]], sid: str, hang_up: bool
) -> Outcome:
    path, body = request
    started = time.monotonic()
    status, request_id, error = 0, None, None
    ok = False
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            async with session.post(base + path, json=body, headers={"x-session-id": sid}) as resp:
                status, request_id = resp.status, resp.headers.get("x-adaptive-spec-request-id")
                if hang_up:
                    await resp.content.read(64)  # the first bytes, then the client goes away
                    resp.close()
                    return Outcome(api, status, True, True, request_id, started, time.monotonic())
                data = await resp.read()
                ok = status == 200 and b'"error"' not in data[-400:]
                if not ok:
                    error = data[-300:].decode(errors="replace")
    except TimeoutError:
        error = "timeout"
    except (aiohttp.ClientError, ConnectionError) as exc:
        error = type(exc).__name__
    return Outcome(api, status, ok, False, request_id, started, time.monotonic(), error)


async def _client(
    n: int, session: aiohttp.ClientSession, base: str, deadline: float, soak: Soak, args: argparse.Namespace
) -> None:
    """Every other turn the plain APIs (six sessions a client, long-lived), else a new agent session (its turns);
    after each request a think time (exponential, mean `--think-s`): the server has idle moments, as it has with
    agents that run tools between turns, and the store saves heads only when it is idle (a save pauses it)."""
    rng, shapes, tokens = random.Random(n), load_shapes(), args.max_tokens
    turn = 0
    while time.monotonic() < deadline:
        turn += 1
        if turn % 2:
            api = APIS[(n + turn // 2) % len(APIS)]
            requests, sid = [(api, _request(api, tokens))], f"soak-{n}-{turn // 2 % 6}"
        else:
            label, turns = session_turns(shapes, rng, tokens)
            requests, sid = [(label, t) for t in turns], f"agent-{n}-{turn}"
        for api, request in requests:
            if time.monotonic() >= deadline:
                return
            soak.outcomes.append(await _one(session, base, api, request, sid, rng.random() < HANG_UP_SHARE))
            await asyncio.sleep(rng.expovariate(1 / args.think_s) if args.think_s > 0 else 0)


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(x) for x in text]
    return out


def _llama_servers(proxy_pid: int) -> list[int]:
    pids = []
    for child in _children(proxy_pid):
        try:
            cmd = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        if cmd.endswith(b"llama-server"):
            pids.append(child)
    return pids


def _threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


async def _all_up(proxy: ProxyProcess) -> bool:
    profiles = await asyncio.to_thread(http_json, proxy.base + "/adaptive/profiles")
    return all(p["up"] for p in profiles["profiles"])


async def _killer(proxy: ProxyProcess, soak: Soak, every: float, deadline: float) -> None:
    while time.monotonic() + every < deadline:
        await asyncio.sleep(every)
        pids = _llama_servers(proxy.proc.pid)
        if not pids:
            continue
        killed = time.monotonic()
        os.kill(pids[0], signal.SIGKILL)
        window = [killed, killed + REQUEST_TIMEOUT_S]
        soak.down.append(window)
        await asyncio.sleep(1.0)
        while time.monotonic() < deadline:
            if _llama_servers(proxy.proc.pid) and await _all_up(proxy):
                window[1] = time.monotonic()
                break
            await asyncio.sleep(0.5)


async def _editor(policy: Path, soak: Soak, every: float, deadline: float) -> None:
    while time.monotonic() + every < deadline:
        await asyncio.sleep(every)
        soak.edits += 1
        text = f"[route]\nhysteresis = {0.1 + 0.05 * (soak.edits % 3):.2f}\n"
        text += f"[heads]\nmin_tokens = {MIN_TOKENS[soak.edits % len(MIN_TOKENS)]}\n"
        await asyncio.to_thread(policy.write_text, text)


async def _tasks(proxy: ProxyProcess) -> int:
    """The asyncio tasks alive in the proxy's loop, from its /metrics gauge."""
    found = _TASKS.search(await asyncio.to_thread(http_text, proxy.base + "/metrics"))
    return int(float(found.group(1))) if found else -1


async def _sample(proxy: ProxyProcess, soak: Soak, started: float) -> dict[str, Any]:
    heads = await asyncio.to_thread(http_json, proxy.base + "/adaptive/heads")
    return {
        "minute": round((time.monotonic() - started) / 60, 1),
        **process_figures(proxy.proc.pid),
        "threads": _threads(proxy.proc.pid),
        "tasks": await _tasks(proxy),
        "requests": len(soak.outcomes),
        "store": store_sample(heads, soak.heads_dir),
    }


async def _sampler(proxy: ProxyProcess, soak: Soak, every: float, deadline: float, started: float) -> None:
    while True:
        soak.samples.append(await _sample(proxy, soak, started))
        if time.monotonic() + every > deadline:
            return
        await asyncio.sleep(every)


async def _warm_up(session: aiohttp.ClientSession, proxy: ProxyProcess, soak: Soak, args: argparse.Namespace) -> None:
    """One agent session a stream at once, until the store has kept their heads, then a pause: the threads the
    proxy's pools start on first use (the store's file work runs in them) are there before the first idle sample."""
    shapes = load_shapes()

    async def one(n: int) -> None:
        label, turns = session_turns(shapes, random.Random(-1 - n), args.max_tokens)
        soak.outcomes.append(await _one(session, proxy.base, label, turns[0], f"warm-up-{n}", False))

    await asyncio.gather(*(one(n) for n in range(args.streams)))
    for _ in range(60):
        if (await asyncio.to_thread(http_json, proxy.base + "/adaptive/heads"))["pending"] == 0:
            break
        await asyncio.sleep(0.5)
    await asyncio.sleep(IDLE_S)


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    model = write_tiny_gguf(workdir / "tiny-random-llama.gguf")
    trace, policy = workdir / "trace.jsonl", workdir / "policy.toml"
    policy.write_text(f"[route]\nhysteresis = 0.15\n[heads]\nmin_tokens = {MIN_TOKENS[0]}\n")
    env = {"ADAPTIVE_SPEC_STATE_DIR": str(workdir / "state"), "ADAPTIVE_SPEC_CONFIG_DIR": str(workdir / "config")}
    argv = ["--model", str(model), "--threads", "1", "--ctx-size", str(CTX_SIZE), "--parallel", "4"]
    argv += ["--policy", str(policy), "--heads-dir", str(workdir / "heads"), "--heads-max-gb", str(args.heads_max_gb)]
    argv += ["--trace", str(trace), "--trace-max-mb", "256", "--history", "1000"]
    argv += ["--echo-fingerprints", str(ECHO_FINGERPRINTS)]
    proxy = await asyncio.to_thread(ProxyProcess, *argv, env=env)
    soak = Soak(heads_dir=workdir / "heads")
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            await _warm_up(session, proxy, soak, args)
            started = time.monotonic()
            soak.idle.append(await _sample(proxy, soak, started))
            deadline = started + args.minutes * 60
            tasks = [
                asyncio.create_task(_client(n, session, proxy.base, deadline, soak, args)) for n in range(args.streams)
            ]
            tasks += [
                asyncio.create_task(_killer(proxy, soak, args.kill_every, deadline)),
                asyncio.create_task(_editor(policy, soak, args.edit_every, deadline)),
                asyncio.create_task(_sampler(proxy, soak, args.sample_every, deadline, started)),
            ]
            await asyncio.gather(*tasks)
        await asyncio.sleep(IDLE_S)
        soak.idle.append(await _sample(proxy, soak, started))
        route = await asyncio.to_thread(http_json, proxy.base + "/adaptive/route")
        return _figures(args, soak, trace, route, proxy)
    finally:
        await asyncio.to_thread(proxy.stop)
        if args.out is not None:  # serve's own log beside the figures: the reasons behind them
            args.out.with_suffix(".log").write_text(proxy.log())


def _figures(
    args: argparse.Namespace, soak: Soak, trace: Path, route: dict[str, Any], proxy: ProxyProcess
) -> dict[str, Any]:
    failed = [o for o in soak.outcomes if not o.ok]
    unexpected = [o for o in failed if not soak.expected_failure(o)]
    answered = [o.request_id for o in soak.outcomes if o.request_id]
    first, last = (soak.samples[1] if len(soak.samples) > 2 else soak.samples[0]), soak.samples[-1]
    tail = next(x for x in soak.samples if x["minute"] >= last["minute"] * 2 / 3)
    before, after = soak.idle
    left = {k: after[k] - before[k] for k in ("fds", "threads", "tasks")}
    return {
        "minutes": args.minutes,
        "streams": args.streams,
        "requests": len(soak.outcomes),
        "by_api": dict(Counter(o.api for o in soak.outcomes)),
        "hung_up": sum(1 for o in soak.outcomes if o.hung_up),
        "kills": len(soak.down),
        "down_s": [round(end - start, 1) for start, end in soak.down],
        "policy_edits": soak.edits,
        "failed_expected": len(failed) - len(unexpected),
        "failed_expected_by_status": dict(Counter(str(o.status or o.error) for o in failed if o not in unexpected)),
        "failed_unexpected": len(unexpected),
        "unexpected_examples": [{"api": o.api, "status": o.status, "error": o.error} for o in unexpected[:5]],
        "expected_examples": _examples([o for o in failed if o not in unexpected and not o.hung_up]),
        "trace": trace_check(trace, answered),
        "samples": soak.samples,
        "idle_samples": soak.idle,
        "rss_growth_kib": last["rss_kib"] - first["rss_kib"],
        "rss_growth_last_third_kib": last["rss_kib"] - tail["rss_kib"],
        "fds_growth": last["fds"] - first["fds"],
        "threads_growth": last["threads"] - first["threads"],
        "tasks_growth": last["tasks"] - first["tasks"],
        "idle_growth": left,
        "flat": last["rss_kib"] - tail["rss_kib"] <= RSS_SLACK_KIB and all(v <= 0 for v in left.values()),
        "store_ok": _store_ok(soak),
        "router_in_flight_after": route["in_flight"],
        "store": _store_figures(soak),
        "policy_reloads_in_log": proxy.log().count("policy"),
    }


def _examples(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    """One failure of each API and status: what the client was told."""
    seen: dict[tuple[str, int], Outcome] = {}
    for o in outcomes:
        seen.setdefault((o.api, o.status), o)
    return [{"api": o.api, "status": o.status, "error": (o.error or "")[-200:]} for o in list(seen.values())[:8]]


def _store_figures(soak: Soak) -> dict[str, Any]:
    """The head store over the run: its bytes at each sample against its bound, and its counts by outcome at the end
    (saved, restored, evicted, warm_started after a restart, taken, inert, failed, refused)."""
    samples = [s["store"] for s in soak.samples + soak.idle]
    return {
        "max_bytes": samples[-1]["max_bytes"],
        "bytes_by_minute": [(s["minute"], s["store"]["bytes"], s["store"]["heads"]) for s in soak.samples],
        "bytes_peak": max(s["bytes"] for s in samples),
        "disk_bytes_peak": max(s["disk_bytes"] for s in samples),
        "within_bound": all(s["bytes"] <= s["max_bytes"] and s["disk_bytes"] <= s["max_bytes"] for s in samples),
        "counts": soak.idle[-1]["store"]["counts"],
    }


def _store_ok(soak: Soak) -> bool:
    """The bound held at every sample, and the store was exercised: heads saved, restored and evicted."""
    figures = _store_figures(soak)
    counts = figures["counts"]
    return bool(figures["within_bound"]) and all(counts.get(k, 0) > 0 for k in ("saved", "restored", "evicted"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--kill-every", type=float, default=300.0, help="seconds between llama-server kills")
    parser.add_argument("--edit-every", type=float, default=120.0, help="seconds between policy file edits")
    parser.add_argument("--think-s", type=float, default=1.5, help="a client's mean pause after each request")
    parser.add_argument("--heads-max-gb", type=float, default=HEADS_MAX_GB, help="the head store's bound (GiB)")
    parser.add_argument("--sample-every", type=float, default=60.0, help="seconds between process samples")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        figures = asyncio.run(run(args, Path(tmp)))
    write_figures(figures, args.out)
    clean = figures["failed_unexpected"] == 0 and figures["trace"]["recorded_exactly_once"] and figures["flat"]
    clean = clean and figures["store_ok"]
    return 0 if clean and not any(figures["router_in_flight_after"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
