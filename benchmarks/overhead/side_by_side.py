"""Proxy overhead side by side, in one run: the same fast upstream streamed directly, through a minimal aiohttp
forwarder (the Python floor), through the same forwarder that also parses the body once and reads the answer's
text once after its end (floor+read: the least any proxy that routes on what it sees must do), through adaptive-spec
(the real `serve`, attached, sessions and routing on) and, when its binary is given, through LiteLLM's proxy.

Run:  .venv/bin/python -m benchmarks.overhead.side_by_side [--fixtures DIR] [--body-file BODY.json] [--litellm PATH]
      [--levels 1,8,32] [--chunks 200] [--rounds N] [--out benchmarks/results/overhead.json]
      [--watched] [--other-src NAME=SRC] [--loops]
      .venv/bin/python -m benchmarks.overhead.side_by_side --gaps --fixtures DIR  # gaps beside a heavy session

Bodies: a tiny chat request (another session each time), and with `--fixtures` (the recorded agent requests, see
`benchmarks/harness/agent_bodies.py`) opencode's largest recorded request (~7k tokens, 10 tools), the same grown to a
100k-token history and to 484 KB (`opencode-120k`: ~120k tokens, 131k of Qwen2.5's); `--body-file` adds one of your
own. A real body is sent by each concurrent stream under its own session id, the same body each round (a session's
next turn, with nothing new in it); its `-noid` twin (`opencode-120k-noid`) is the same body without any session id,
as aider, llm and the openai SDK send it, and as every agent's first request of a conversation is: nothing the proxy
served comes back in it, so each request is a new conversation with its whole history. For a body with a session id
the first three turns of each stream's session (the warm-up) are shown apart: a turn that waits on its previous turn's
statistics shows there, not in the medians. The upstream is llama-server shaped (its chat chunks field for field,
per-token `timings` when asked, a final timings chunk, /props, /slots, /tokenize); its /props names the embedded
model's GGUF, so adaptive-spec tokenizes with that vocabulary as `serve` does by default. `--tokenizer endpoint`: its
/props names a GGUF that is not on this machine (the usual case for a proxy in front of a GPU box), so adaptive-spec
takes tokens from the upstream's /tokenize, one HTTP call per new text; the tokenizer `serve` chose is read from its
log and written with the figures. `--profile FILE` records adaptive-spec's process and its worker with py-spy
(`--py-spy`, a path) over the measured rounds, in py-spy's raw (collapsed stacks) format. `--watched` adds a second
adaptive-spec with a live view attached to its event feed (as the TUI is: the proxy then asks for per-token timings
and cuts them out again); `--other-src` another version of it, e.g. an earlier commit's `src/` from `git worktree
add`, measured in the same rounds; `--variant NAME=ARGS` the same version with more `serve` arguments (`--variant "no
statistics=--tokenizer off"`: what the statistics worker costs the streams). `--loops`: the event loops side by side,
"adaptive-spec" on Python's asyncio loop and "adaptive-spec uvloop" on uvloop's, with both floors on both loops; a
target on uvloop is measured against the floors on uvloop. Each target runs in its own process, the client in this
one; rounds are interleaved (direct, floor, adaptive-spec, LiteLLM, then the reverse order), and the figures are
medians, with each target's added time and its ratio to the floor's, and its CPU time per request (its process and
children's, from /proc: the work that queues under concurrency on a machine of few cores).

`--gaps`: 8 concurrent streams whose chunks the upstream paces 2 ms apart, through adaptive-spec, in rounds that
alternate between nothing else and a heavy session finishing alongside (a new session whose first request brings a
100k-token history: its statistics update indexes all of it). Prints the inter-chunk gap p50/p99 of both.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from tests.support.fakes.fast_upstream import PATH
from tests.support.fakes.fast_upstream import run as upstream_main

from adaptive_spec.llama.launch import free_port
from adaptive_spec.streams.meter import ResponseMeter
from benchmarks.harness import ROOT, results
from benchmarks.harness.agent_bodies import grown, load
from benchmarks.harness.stats import percentile

# llama-server's chat chunk, field for field (b11434). Texts differ from one chunk to the next: LiteLLM ends a stream
# that repeats a chunk ("the model is repeating").
NAME = "benchmarks.overhead.side_by_side"  # the result file's `benchmark`
# LiteLLM refuses to start with a short master key; one key for every target (the others ignore it), fixed so that
# the client processes send the one the proxy was started with.
BENCH_KEY = "sk-overhead-bench-7f3c9a0d1e5b4c2a8f6d0b9e3a71c5d2"


def _floor_main(port: int, upstream_port: int, read: bool = False, uv: bool = False) -> None:
    """The Python floor: read, forward, relay; no parsing. `read`: the floor of any proxy that routes on what it
    sees ("floor+read"): the body parsed once, and the answer's text read once, in one batch, after its end.
    `uv`: on uvloop's event loop (`--loops`)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if read:
            orjson.loads(body)
        client: aiohttp.ClientSession = request.app["client"]
        url = f"http://127.0.0.1:{upstream_port}{request.path}"
        kept: list[bytes] = []
        async with client.post(url, data=body, headers={"Content-Type": "application/json"}) as upstream:
            resp = web.StreamResponse(status=upstream.status, headers={"Content-Type": upstream.content_type})
            await resp.prepare(request)
            async for chunk in upstream.content.iter_any():
                await resp.write(chunk)
                if read:
                    kept.append(chunk)
            await resp.write_eof()
        if read:  # the answer's text, read in one batch as adaptive-spec's relay reads it
            meter = ResponseMeter()
            for chunk in kept:
                meter.keep(chunk)
            _ = meter.output.text
        return resp

    async def client_ctx(app: web.Application) -> Any:
        app["client"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        yield
        await app["client"].close()

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.cleanup_ctx.append(client_ctx)
    app.router.add_post(PATH, handle)
    loop = None
    if uv:
        import uvloop

        loop = uvloop.new_event_loop()
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, loop=loop)


@dataclass(frozen=True)
class Body:
    name: str
    body: dict[str, Any] | None  # None: the tiny body, another session each request
    session: bool = True  # a real body sent under each stream's session id (else with none at all)


def _payload(
    body: Body, i: int, stream: int, extra: dict[str, Any] | None = None, level: int = 0
) -> tuple[bytes, dict[str, str]]:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {BENCH_KEY}"}
    if body.body is None:
        messages = [
            {"role": "system", "content": "You are a coding assistant."},
            {"role": "user", "content": f"task {i:08d}: write hello world in C"},
        ]
        obj: dict[str, Any] = {"model": "fake", "stream": True, "temperature": 0, "messages": messages}
    else:
        obj = {**body.body, "model": "fake", "stream": True}
        if body.session:  # each level's streams start sessions of their own: their first turns are seen
            headers["x-session-id"] = f"bench-{body.name}-{level}-{stream}"
    for key in ("stream_options", "max_tokens", "max_completion_tokens"):  # opencode asks for 32,000: the upstream's
        obj.pop(key, None)  # chunk count stays the benchmark's
    return orjson.dumps({**obj, **(extra or {})}), headers


async def _one(session: aiohttp.ClientSession, url: str, data: bytes, headers: dict[str, str]) -> list[float]:
    """Arrival times of the response's chunks, from the request's start (s); the last is the stream's end."""
    started = time.perf_counter()
    times: list[float] = []
    text = b""
    async with session.post(url, data=data, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for chunk in resp.content.iter_any():
            times.append(time.perf_counter() - started)
            text = text[-64:] + chunk
    if b"[DONE]" not in text:  # every target must relay the whole stream, or its times say nothing
        raise RuntimeError(f"{url}: the stream ended before its end marker")
    return times


# Each target's process (its children included: adaptive-spec's statistics worker, LiteLLM's workers), for its CPU time.
PIDS: dict[str, int] = {}
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds (user + system) of a process and of its live descendants, from /proc (Linux; 0 elsewhere)."""
    stats: dict[int, tuple[int, float]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        stats[int(entry.name)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICK)
    own, children, todo = stats.get(pid, (0, 0.0))[1], 0.0, [pid]
    while todo:
        current = todo.pop()
        found = [child for child, (parent, _) in stats.items() if parent == current]
        children += sum(stats[child][1] for child in found)
        todo += found
    return own, children


# The warm-up's times to first chunk (ms) by target, per turn (all streams' of that round): a session's first turns.
FIRST_TURNS: dict[str, list[list[float]]] = {}


async def _measure(targets: dict[str, str], body: Body, conc: int, rounds: int) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {k: [] for k in targets}
    FIRST_TURNS.clear()
    cpu = {name: _cpu_s(pid) for name, pid in PIDS.items() if name in targets}
    n = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def round_of(url: str) -> list[list[float]]:
            nonlocal n
            n += conc
            payloads = [_payload(body, n + j, j, level=conc) for j in range(conc)]
            return await asyncio.gather(*(_one(session, url, d, h) for d, h in payloads))

        for name, url in targets.items():  # warm-up: connections, and each session's first turns
            FIRST_TURNS[name] = [[t[0] * 1000 for t in await round_of(url)] for _ in range(3)]
        order = list(targets.items())
        for r in range(rounds):
            for name, url in order if r % 2 == 0 else order[::-1]:
                out[name] += [(t[0], t[-1]) for t in await round_of(url)]
    requests = (rounds + 3) * conc
    for name, (own, children) in cpu.items():
        now = _cpu_s(PIDS[name])
        CPU_MS[name] = ((now[0] - own) * 1000 / requests, (now[1] - children) * 1000 / requests)
    return out


# The last level's CPU milliseconds per request, by target: its own process's, its children's.
CPU_MS: dict[str, tuple[float, float]] = {}


def _rows(res: dict[str, list[tuple[float, float]]], body: str, conc: int) -> list[dict[str, Any]]:
    med = {
        k: (statistics.median(r[0] for r in v) * 1000, statistics.median(r[1] for r in v) * 1000)
        for k, v in res.items()
    }
    p95 = {k: _pct([r[0] * 1000 for r in v], 0.95) for k, v in res.items()}
    d_first, d_total = med["direct"]
    rows = []
    for name, (first, total) in med.items():
        # With --loops, a target on uvloop is measured against the floors on uvloop.
        loop = " uvloop" if name.endswith(" uvloop") and "floor uvloop" in med else ""
        f_first, f_total = med["floor" + loop]
        r_first, r_total = med.get("floor+read" + loop, (0.0, 0.0))
        added_first, added_total = first - d_first, total - d_total
        rows.append(
            {
                "body": body,
                "streams": conc,
                "target": name,
                "n": len(res[name]),
                "ttfc_p50_ms": first,
                "ttfc_p95_ms": p95[name],
                "ttfc_vs_direct": first / d_first if d_first > 0 else None,
                "added_ttfc_p50_ms": added_first,
                "added_ttfc_vs_floor": added_first / (f_first - d_first) if f_first > d_first else None,
                "whole_p50_ms": total,
                "added_whole_p50_ms": added_total,
                "added_whole_vs_floor": added_total / (f_total - d_total) if f_total > d_total else None,
                "added_ttfc_vs_floor_read": added_first / (r_first - d_first) if r_first > d_first else None,
                "added_whole_vs_floor_read": added_total / (r_total - d_total) if r_total > d_total else None,
                "cpu_ms_per_request": CPU_MS[name][0] if name in CPU_MS else None,
                "children_cpu_ms_per_request": CPU_MS[name][1] if name in CPU_MS else None,
                # TTFC of the warm-up's three rounds (each stream's first three turns): medians over the streams
                "first_turns_ttfc_ms": [statistics.median(t) for t in FIRST_TURNS.get(name, [])],
            }
        )
    return rows


async def _wait(url: str, seconds: float = 180) -> None:
    data, headers = _payload(Body("tiny", None), 0, 0)
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                await _one(session, url, data, headers)
                return
            except (aiohttp.ClientError, RuntimeError):
                await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} never answered")


async def _settled(url: str) -> None:
    """Until the proxy has folded every answer it served into the session statistics: its worker process is up
    (importing, loading the GGUF's vocabulary and making its tokenizer take seconds of CPU, not to be counted in the
    first level's figures)."""
    base = url.removesuffix(PATH)
    async with aiohttp.ClientSession() as session, session.get(f"{base}/adaptive/sessions?drain=1") as resp:
        await resp.read()


def _wait_port(port: int) -> None:
    for _ in range(600):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"port {port} never opened")


def _start_children(
    args: argparse.Namespace, up: int, tmp: Path
) -> tuple[dict[str, str], list[subprocess.Popen[bytes]]]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    ports = {"adaptive-spec": free_port("127.0.0.1"), "LiteLLM": free_port("127.0.0.1")}
    serve = [sys.executable, "-m", "adaptive_spec", "serve", "--port", str(ports["adaptive-spec"])]
    serve += ["--profile", f"plain=http://127.0.0.1:{up}", *args.serve_arg]
    older = list(serve)  # another version (--other-src) may predate --event-loop: it runs on its own default
    if args.loops:  # "adaptive-spec" on Python's own loop, "adaptive-spec uvloop" (a variant, see main) on uvloop's
        serve += ["--event-loop", "asyncio"]
    children = [_spawn(serve, tmp / "adaptive-spec.log", env)]
    urls = {"adaptive-spec": f"http://127.0.0.1:{ports['adaptive-spec']}{PATH}"}
    PIDS["adaptive-spec"] = children[-1].pid
    for spec in args.other_src:  # another version of adaptive-spec, from its own source tree, in the same run
        name, _, src = spec.partition("=")
        port = free_port("127.0.0.1")
        older[older.index("--port") + 1] = str(port)
        other_env = {**env, "PYTHONPATH": f"{Path(src).resolve()}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        children.append(_spawn(older, tmp / f"{name}.log", other_env))
        urls[name] = f"http://127.0.0.1:{port}{PATH}"
        PIDS[name] = children[-1].pid
    for spec in args.variant:  # the same version with other `serve` arguments: what a part of it costs
        name, _, extra = spec.partition("=")
        port = free_port("127.0.0.1")
        variant = [*serve, *extra.split()]
        variant[variant.index("--port") + 1] = str(port)
        children.append(_spawn(variant, tmp / f"{name}.log", env))
        urls[name] = f"http://127.0.0.1:{port}{PATH}"
        PIDS[name] = children[-1].pid
    if args.watched:  # a second one with a live view attached (see _watch): per-token timings asked and cut again
        port = free_port("127.0.0.1")
        serve[serve.index("--port") + 1] = str(port)
        children.append(_spawn(serve, tmp / "adaptive-spec-watched.log", env))
        urls["adaptive-spec watched"] = f"http://127.0.0.1:{port}{PATH}"
        PIDS["adaptive-spec watched"] = children[-1].pid
    if args.litellm:
        config = tmp / "litellm.yaml"
        config.write_text(
            "model_list:\n  - model_name: fake\n    litellm_params:\n      model: openai/fake\n"
            f"      api_base: http://127.0.0.1:{up}/v1\n      api_key: {BENCH_KEY}\n"
            "litellm_settings:\n  telemetry: false\n  drop_params: true\n"
        )
        ll_env = {**env, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "NO_DOCS": "True"}
        ll_env["LITELLM_MASTER_KEY"] = BENCH_KEY
        command = [args.litellm, "--config", str(config), "--port", str(ports["LiteLLM"]), "--host", "127.0.0.1"]
        children.append(_spawn([*command, "--num_workers", "1"], tmp / "litellm.log", ll_env))
        PIDS["LiteLLM"] = children[-1].pid
        urls["LiteLLM"] = f"http://127.0.0.1:{ports['LiteLLM']}{PATH}"
    return urls, children


def _watch(url: str, log: Path) -> subprocess.Popen[bytes]:
    """What a TUI does: read the proxy's live event feed for the whole run (curl in a process of its own, so reading
    it costs the measuring client nothing)."""
    feed = url.replace(PATH, "/adaptive/events")
    return _spawn(["curl", "-sN", "-o", "/dev/null", feed], log, dict(os.environ))


def _spawn(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _stop(children: list[subprocess.Popen[bytes]]) -> None:
    for child in children:
        try:
            os.killpg(child.pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
    for child in children:
        try:
            child.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)


def _bodies(args: argparse.Namespace) -> list[Body]:
    bodies = [Body("tiny", None)]
    if args.fixtures:
        agents = load(Path(args.fixtures))
        if "opencode" in agents:
            bodies.append(Body("opencode-7k", agents["opencode"].body))
            bodies.append(Body("opencode-100k", grown(agents["opencode"], 100_000)[0]))
            # The issue's 484 KB body: 138,000 by agent_bodies' sizing (3.6 characters a token), 131k Qwen2.5 tokens.
            big = grown(agents["opencode"], 138_000)[0]
            bodies.append(Body("opencode-120k", big))
            bodies.append(Body("opencode-120k-noid", big, session=False))
    if args.body_file:
        bodies.append(Body(Path(args.body_file).stem, json.loads(Path(args.body_file).read_text())))
    return bodies


def _burn(ms: float) -> None:
    """Pure-Python work for `ms` milliseconds (a stand-in for a statistics update in a process of its own)."""
    end = time.perf_counter() + ms / 1000
    n = 0
    while time.perf_counter() < end:
        n += 1


async def _gaps(url: str, heavy: dict[str, Any], rounds: int, burn_ms: float, conc: int = 8) -> dict[str, Any]:
    """Inter-chunk gaps of `conc` paced streams, in rounds alternating alone / with a heavy session finishing (and,
    with `burn_ms`, as much pure-Python work in another process at the same time)."""
    gaps: dict[str, list[float]] = {"alone": [], "with a heavy session": []}
    stream = Body("tiny", None)
    loop = asyncio.get_running_loop()
    burner = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) if burn_ms else None
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for r in range(rounds + 2):
            loaded = r % 2 == 1
            payloads = [_payload(stream, r * 100 + j, j, {"max_tokens": 150, "pace_ms": 2}) for j in range(conc)]
            tasks: list[Awaitable[Any]] = [_one(session, url, d, h) for d, h in payloads]
            if loaded:  # a new session each round: its first request brings the whole history
                data, headers = _payload(Body(f"heavy{r}", heavy), r, 0, {"max_tokens": 5})
                tasks.append(_one(session, url, data, headers))
                if burner is not None:
                    tasks.append(loop.run_in_executor(burner, _burn, burn_ms))
            results = await asyncio.gather(*tasks)
            if r < 2:
                continue  # warm-up
            for times in results[:conc]:
                gaps["with a heavy session" if loaded else "alone"] += [
                    (b - a) * 1000 for a, b in itertools.pairwise(times)
                ]
        async with session.get(url.replace(PATH, "/metrics")) as resp:  # the heavy sessions' updates did happen
            updates = [line for line in (await resp.text()).splitlines() if "session_updates_total{" in line]
    if burner is not None:
        burner.shutdown()
    out: dict[str, Any] = {k: {"p50_ms": _pct(v, 0.5), "p99_ms": _pct(v, 0.99), "n": len(v)} for k, v in gaps.items()}
    out["p99_ratio"] = out["with a heavy session"]["p99_ms"] / out["alone"]["p99_ms"]
    out["session_updates"] = updates
    return out


def _pct(values: list[float], q: float) -> float:
    value = percentile(values, q)
    return float("nan") if value is None else value


def _print(rows: list[dict[str, Any]], chunks: int) -> None:
    print(f"\n{chunks} SSE chunks per stream, {os.cpu_count()} cores; medians over interleaved rounds")
    print(
        "| body | streams | target | n | TTFC p50 / p95 ms | ×direct | added TTFC p50 ms | ×floor | ×floor+read "
        "| added whole stream p50 ms | ×floor | ×floor+read | CPU ms/request: process + children "
        "| first turns TTFC ms |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    def ratio(value: float | None) -> str:
        return f"{value:.2f}" if value is not None else "-"

    for r in rows:
        if r["target"] == "direct":
            continue
        cpu = "-"
        if r.get("cpu_ms_per_request") is not None:
            cpu = f"{r['cpu_ms_per_request']:.2f} + {r['children_cpu_ms_per_request']:.2f}"
        turns = " / ".join(f"{t:.1f}" for t in r.get("first_turns_ttfc_ms", []))
        print(
            f"| {r['body']} | {r['streams']} | {r['target']} | {r['n']} "
            f"| {r['ttfc_p50_ms']:.2f} / {r['ttfc_p95_ms']:.2f} | {ratio(r['ttfc_vs_direct'])} "
            f"| {r['added_ttfc_p50_ms']:.2f} "
            f"| {ratio(r['added_ttfc_vs_floor'])} | {ratio(r['added_ttfc_vs_floor_read'])} "
            f"| {r['added_whole_p50_ms']:.2f} | {ratio(r['added_whole_vs_floor'])} "
            f"| {ratio(r['added_whole_vs_floor_read'])} | {cpu} | {turns} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=200, help="SSE chunks per streamed response")
    parser.add_argument("--rounds", type=int, default=0, help="rounds per level (default: 150 / 30 / 10)")
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--fixtures", default="", help="directory of recorded agent requests (real bodies)")
    parser.add_argument("--bodies", default="", help="only these (tiny, opencode-7k, opencode-100k, a file stem)")
    parser.add_argument("--body-file", default="", help="a JSON chat request body to send as well")
    parser.add_argument("--litellm", default="", help="LiteLLM's proxy binary (`litellm`), in a venv of its own")
    parser.add_argument("--serve-arg", action="append", default=[], help="an extra `serve` argument (repeatable)")
    other = "also `serve` from another source tree (its src/ directory), e.g. an earlier commit's"
    parser.add_argument("--other-src", action="append", default=[], metavar="NAME=SRC", help=other)
    variant = "adaptive-spec again with more `serve` arguments, e.g. 'no statistics=--tokenizer off' (repeatable)"
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS", help=variant)
    loops = (
        "the event loops side by side: adaptive-spec on Python's asyncio loop and on uvloop's, each floor on both "
        "(ratios against the same loop's floor+read are printed at the end)"
    )
    parser.add_argument("--loops", action="store_true", help=loops)
    parser.add_argument("--watched", action="store_true", help="also adaptive-spec with a live view attached")
    parser.add_argument("--gaps", action="store_true", help="inter-chunk gaps with and without a heavy session")
    parser.add_argument("--burn-ms", type=float, default=0, help="--gaps: pure-Python work in another process too")
    tokenizer = "the proxy's tokenizer: the embedded GGUF's vocabulary (as `serve` on it), or the upstream's /tokenize"
    parser.add_argument("--tokenizer", choices=("gguf", "endpoint"), default="gguf", help=tokenizer)
    parser.add_argument("--profile", default="", help="record adaptive-spec with py-spy into this file (raw format)")
    parser.add_argument("--py-spy", default="py-spy", help="--profile: the py-spy binary")
    parser.add_argument("--out", default="benchmarks/results/overhead.json")
    repeat = (
        "repeat the whole measurement this many times, each with every target started afresh, and print each "
        "ratio's median run and range"
    )
    parser.add_argument("--runs", type=int, default=1, help=repeat)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers it started (the `finally` below)
    if args.gaps and not args.fixtures:
        parser.error("--gaps needs --fixtures (the heavy session's body)")
    if args.litellm and not Path(args.litellm).exists():
        parser.error(f"--litellm {args.litellm}: no such file")
    if args.loops:
        args.variant.append("adaptive-spec uvloop=--event-loop uvloop")
    runs = [_run_once(args, n) for n in range(args.runs)]
    result: dict[str, Any] = (
        runs[0] if args.runs == 1 else {"runs": runs, "spread": _spread([r.get("rows", []) for r in runs])}
    )
    if args.runs > 1 and not args.gaps:
        _print_spread(result["spread"], args.runs)
    _write(Path(args.out), result)
    print(f"\nwritten to {args.out}")
    return 0


def _run_once(args: argparse.Namespace, run: int) -> dict[str, Any]:
    """One run: every target started afresh, measured, stopped."""
    if args.runs > 1:
        print(f"\n## run {run + 1} of {args.runs}")
    ctx = multiprocessing.get_context("spawn")
    up, floor, floor_read = free_port("127.0.0.1"), free_port("127.0.0.1"), free_port("127.0.0.1")
    procs = [
        ctx.Process(target=upstream_main, args=(up, args.chunks, _model_path(args)), daemon=True),
        ctx.Process(target=_floor_main, args=(floor, up), daemon=True),
        ctx.Process(target=_floor_main, args=(floor_read, up, True), daemon=True),
    ]
    floors = {"floor": floor, "floor+read": floor_read}
    if args.loops:  # the floors on uvloop too: each loop's proxy against its own loop's floor
        floors |= {"floor uvloop": free_port("127.0.0.1"), "floor+read uvloop": free_port("127.0.0.1")}
        procs.append(ctx.Process(target=_floor_main, args=(floors["floor uvloop"], up, False, True), daemon=True))
        procs.append(ctx.Process(target=_floor_main, args=(floors["floor+read uvloop"], up, True, True), daemon=True))
    for proc in procs:
        proc.start()
    for name, proc in zip(floors, procs[1:], strict=True):
        PIDS[name] = proc.pid or 0
    tmp = Path(tempfile.mkdtemp(prefix="overhead-"))
    children: list[subprocess.Popen[bytes]] = []
    profiler: subprocess.Popen[bytes] | None = None
    try:
        _wait_port(up)
        urls, children = _start_children(args, up, tmp)
        targets = {"direct": f"http://127.0.0.1:{up}{PATH}"}
        targets |= {name: f"http://127.0.0.1:{port}{PATH}" for name, port in floors.items()} | urls
        for url in targets.values():
            asyncio.run(_wait(url))
        for name, url in targets.items():  # each adaptive-spec's statistics worker started (its tokenizer made)
            if name != "direct" and name not in floors and name != "LiteLLM":
                asyncio.run(_settled(url))
        if "adaptive-spec watched" in targets:
            children.append(_watch(targets["adaptive-spec watched"], tmp / "feed.log"))
        result: dict[str, Any] = {"chunks": args.chunks, "cores": os.cpu_count(), "tokenizer": args.tokenizer}
        result["proxy_tokenizer"] = _proxy_tokenizer(tmp / "adaptive-spec.log")
        print(f"adaptive-spec's tokens: {result['proxy_tokenizer']}")
        if args.profile:
            profiler = _profile(args, PIDS["adaptive-spec"], tmp / "py-spy.log")
        if args.gaps:
            heavy = grown(load(Path(args.fixtures))["opencode"], 100_000)[0]
            result["gaps"] = asyncio.run(_gaps(urls["adaptive-spec"], heavy, args.rounds or 20, args.burn_ms))
            print(json.dumps(result["gaps"], indent=2))
        else:
            rows: list[dict[str, Any]] = []
            result["rows"] = rows
            wanted = set(args.bodies.split(",")) if args.bodies else None
            for body in _bodies(args):
                if wanted is not None and body.name not in wanted:
                    continue
                for conc in [int(x) for x in args.levels.split(",")]:
                    rounds = args.rounds or {1: 150, 8: 30}.get(conc, 10)
                    level = _rows(asyncio.run(_measure(targets, body, conc, rounds)), body.name, conc)
                    rows += level
                    _print(level, args.chunks)  # as it goes: a long run shows what it has
                    _write(Path(args.out), result)
            _print(rows, args.chunks)
    finally:
        if profiler is not None:  # py-spy writes its file on an interrupt
            profiler.send_signal(signal.SIGINT)
            profiler.wait(60)
        _stop(children)
        for proc in procs:
            proc.terminate()
            proc.join(5)
    print(f"(logs in {tmp})")
    return result


def _spread(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per body, level and target: each run's ratios to floor+read (time to first chunk, p50 and p95), their median
    and range over the runs. One run's ratio moves with the machine's state (floor+read's own added time moved
    1.8-3.0 ms between runs of one build): a target is judged on the median run."""
    by: dict[tuple[str, int, str], list[dict[str, Any]]] = {}
    for rows in runs:
        p95 = {(r["body"], r["streams"]): r["ttfc_p95_ms"] for r in rows if r["target"] == "floor+read"}
        for r in rows:
            if r["target"] == "direct":
                continue
            key = (r["body"], r["streams"], r["target"])
            floor_p95 = p95.get((r["body"], r["streams"]))
            by.setdefault(key, []).append(
                {
                    "vs_floor_read": r["added_ttfc_vs_floor_read"],
                    "p95_vs_p50": r["ttfc_p95_ms"] / r["ttfc_p50_ms"],
                    "p95_vs_floor_read_p95": r["ttfc_p95_ms"] / floor_p95 if floor_p95 else None,
                    "added_p50_ms": r["added_ttfc_p50_ms"],
                }
            )
    out = []
    for (body, streams, target), values in by.items():
        row: dict[str, Any] = {"body": body, "streams": streams, "target": target}
        for name in ("vs_floor_read", "p95_vs_p50", "p95_vs_floor_read_p95", "added_p50_ms"):
            got = [v[name] for v in values if v[name] is not None]
            row[name] = {"median": statistics.median(got), "min": min(got), "max": max(got)} if got else None
        out.append(row)
    return out


def _print_spread(spread: list[dict[str, Any]], runs: int) -> None:
    print(f"\nover {runs} runs (each its own processes): the median run [the range]")
    print("| body | streams | target | added TTFC p50 ms | ×floor+read | TTFC p95 ÷ p50 | p95 ÷ floor+read's p95 |")
    print("|---|---|---|---|---|---|---|")

    def cell(value: dict[str, float] | None) -> str:
        return f"{value['median']:.2f} [{value['min']:.2f}, {value['max']:.2f}]" if value else "-"

    for r in spread:
        print(
            f"| {r['body']} | {r['streams']} | {r['target']} | {cell(r['added_p50_ms'])} | {cell(r['vs_floor_read'])} "
            f"| {cell(r['p95_vs_p50'])} | {cell(r['p95_vs_floor_read_p95'])} |"
        )


def _proxy_tokenizer(log: Path) -> str:
    """Where `serve` said its session statistics take their tokens from (its start-up line)."""
    for line in log.read_text(errors="replace").splitlines():
        if "sessions: tokens from" in line:
            return line.split("sessions: tokens from", 1)[1].strip()
    return "unknown"


def _profile(args: argparse.Namespace, pid: int, log: Path) -> subprocess.Popen[bytes]:
    """py-spy sampling adaptive-spec and its statistics worker until the run ends (stopped with the servers)."""
    command = [args.py_spy, "record", "--pid", str(pid), "--subprocesses", "--rate", "500", "--format", "raw"]
    return _spawn([*command, "--nonblocking", "-o", str(Path(args.profile).resolve())], log, dict(os.environ))


def _model_path(args: argparse.Namespace) -> str:
    """The GGUF the fake upstream names in /props: the embedded default model with `--tokenizer gguf`."""
    if args.tokenizer == "endpoint":
        return "/nonexistent/fake.gguf"
    from adaptive_spec.llama.models import DEFAULT_MODEL, ensure_embedded

    return str(ensure_embedded(DEFAULT_MODEL))


def _write(out: Path, result: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    results.write(out, NAME, result)


if __name__ == "__main__":
    sys.exit(main())
