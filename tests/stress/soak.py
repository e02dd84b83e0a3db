"""A day of traffic, compressed: `adaptive-spec serve` (its own process, loopback only) on two launched profiles (the
tiny random-weight model, -t 1, --parallel 4) for `--minutes`, with `--streams` clients sending one request after
another over every API the proxy speaks (chat/completions streamed and not, completions, Responses, Anthropic
Messages), a share of them hanging up mid-answer, the profiles' llama-server killed (SIGKILL) every
`--kill-every` seconds (the launcher restarts it), and the policy file edited every `--edit-every` seconds.

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
- at the end nothing is left in flight in the router.

Run (from the repository root, on demand, not in CI):
  python -m tests.stress.soak --minutes 60 --streams 64 --out soak.json
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
from tests.support.servers import ProxyProcess, http_json, http_text
from tests.support.tiny_gguf import write_tiny_gguf

REQUEST_TIMEOUT_S = 120.0
DOWN_GRACE_S = 10.0  # after the launcher has a killed server back, requests already failing may still end
HANG_UP_SHARE = 0.1
IDLE_S = 6.0  # after the last client: the proxy's idle upstream connections are gone (kept 2 s, swept every 2 s)
# The reply echo's bound for the soak: full within the first minute. At the default (200,000 replies and as many
# lines, ~70 MiB) it fills for ~40 minutes at 64 streams, growth that a shorter run could not tell from a leak.
ECHO_FINGERPRINTS = 2048
RSS_SLACK_KIB = 2048  # over the run's last third, growth beyond this is memory kept
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
    session: aiohttp.ClientSession, base: str, api: str, sid: str, max_tokens: int, hang_up: bool
) -> Outcome:
    path, body = _request(api, max_tokens)
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


async def _client(n: int, session: aiohttp.ClientSession, base: str, deadline: float, soak: Soak, tokens: int) -> None:
    rng = random.Random(n)
    turn = 0
    while time.monotonic() < deadline:
        api = APIS[(n + turn) % len(APIS)]
        sid = f"soak-{n}-{turn % 6}"
        turn += 1
        soak.outcomes.append(await _one(session, base, api, sid, tokens, rng.random() < HANG_UP_SHARE))


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
        await asyncio.to_thread(policy.write_text, text)


async def _tasks(proxy: ProxyProcess) -> int:
    """The asyncio tasks alive in the proxy's loop, from its /metrics gauge."""
    found = _TASKS.search(await asyncio.to_thread(http_text, proxy.base + "/metrics"))
    return int(float(found.group(1))) if found else -1


async def _sample(proxy: ProxyProcess, soak: Soak, started: float) -> dict[str, Any]:
    return {
        "minute": round((time.monotonic() - started) / 60, 1),
        **process_figures(proxy.proc.pid),
        "threads": _threads(proxy.proc.pid),
        "tasks": await _tasks(proxy),
        "requests": len(soak.outcomes),
    }


async def _sampler(proxy: ProxyProcess, soak: Soak, every: float, deadline: float, started: float) -> None:
    while True:
        soak.samples.append(await _sample(proxy, soak, started))
        if time.monotonic() + every > deadline:
            return
        await asyncio.sleep(every)


async def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    model = write_tiny_gguf(workdir / "tiny-random-llama.gguf")
    trace, policy = workdir / "trace.jsonl", workdir / "policy.toml"
    policy.write_text("[route]\nhysteresis = 0.15\n")
    env = {"ADAPTIVE_SPEC_STATE_DIR": str(workdir / "state"), "ADAPTIVE_SPEC_CONFIG_DIR": str(workdir / "config")}
    argv = ["--model", str(model), "--threads", "1", "--ctx-size", "8192", "--parallel", "4", "--policy", str(policy)]
    argv += ["--trace", str(trace), "--trace-max-mb", "256", "--history", "1000"]
    argv += ["--echo-fingerprints", str(ECHO_FINGERPRINTS)]
    proxy = await asyncio.to_thread(ProxyProcess, *argv, env=env)
    soak = Soak()
    try:
        started = time.monotonic()
        soak.idle.append(await _sample(proxy, soak, started))
        deadline = started + args.minutes * 60
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            tasks = [
                asyncio.create_task(_client(n, session, proxy.base, deadline, soak, args.max_tokens))
                for n in range(args.streams)
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
        "router_in_flight_after": route["in_flight"],
        "policy_reloads_in_log": proxy.log().count("policy"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--kill-every", type=float, default=300.0, help="seconds between llama-server kills")
    parser.add_argument("--edit-every", type=float, default=120.0, help="seconds between policy file edits")
    parser.add_argument("--sample-every", type=float, default=60.0, help="seconds between process samples")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        figures = asyncio.run(run(args, Path(tmp)))
    write_figures(figures, args.out)
    clean = figures["failed_unexpected"] == 0 and figures["trace"]["recorded_exactly_once"] and figures["flat"]
    return 0 if clean and not any(figures["router_in_flight_after"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
