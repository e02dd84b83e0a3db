"""The proxy's own work per request, stage by stage, with real agents' bodies grown to long histories: the
request handler's own named stages, called as it calls them.

Run:  .venv/bin/python -m benchmarks.overhead.stages --fixtures DIR [--sizes 10000,50000,100000] [--reps 15]
      [--cases next,next-noid,first-noid,again-noid] [--tokenizer tiktoken|endpoint]
      [--out benchmarks/results/overhead_stages.json]

DIR holds the recorded agent requests (`<agent>.jsonl`, see `benchmarks/harness/agent_bodies.py` for how they are
grown). For each agent and history size a session is replayed: the grown request is served (parsed, grouped, routed,
finished with llama-server-shaped timings, its statistics folded in), then the next turn (the same history plus one
small file read) is timed stage by stage: the handler's stage functions (`requests/handler.py`: `read`, `group`,
`rewrite`, `route`; the sending stage's `outgoing.upstream_body`; the lifecycle's `finish`) called in its order on an
app `build_app` made (one profile of one slot, no server behind it: nothing is forwarded), on a fresh copy of that
state each repetition. No instrumentation is compiled into the proxy: the stages are timed from here.

Cases (`--cases`): `next` is that next turn under the agent's own session id (as recorded: opencode and Codex send
one; llm and the openai SDK none, so theirs is grouped by the reply echo anyway); `next-noid` the same with every
session id taken out of the headers and the body (grouped by the reply echo: the tool-call id or the reply it carries
back); `first-noid` the grown request itself, without ids, as a new conversation's first request (nothing in it was
served: grouping reads the whole history for served lines, with 200 other sessions' replies known, and the pieces and
the statistics start from nothing); `again-noid` that first request sent once more (a retry, or what
`side_by_side.py`'s `-noid` bodies are: a new conversation each time, its texts seen before). `--tokenizer endpoint`:
tokens from a llama-server shaped `/tokenize` in a process of its own (`side_by_side.py`'s upstream), one HTTP call
per new text, as for a GGUF that is not on this machine; the default is tiktoken o200k in a thread.

Stages: read (`handler.read`: `parse_body`, orjson plus the shape checks), group (`handler.group`: the workspace's
path scan, also timed on its own as workspace; session grouping, the project and its policy), rewrite
(`handler.rewrite`: a shape llama-server refuses, an agent's loop), route (`handler.route`: the session's statistics
read, the heads' views, `Router.route` and the move carried out; the router's pieces, the prompt's per-piece
fingerprints, and estimate, new prompt tokens against the session's prefix state, also timed on their own), upstream
body (`outgoing.upstream_body`, what is sent: the client's bytes, with the speculation fields added), chunk (relay +
meter of one SSE chunk, in µs), finish (`RequestLifecycle.finish`: router learns + session bookkeeping + record +
publish), worker loop / worker thread (the after-response statistics update: the part on the event loop and the
part in its thread, tokenizing excluded), tokenize (the update's tokenizer call, wall time: in a thread, or the HTTP
calls to /tokenize).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import multiprocessing
import socket
import statistics
import sys
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from adaptive_spec.common.headers import PARENT_SESSION_HEADERS, SESSION_HEADERS
from adaptive_spec.llama.launch import free_port
from adaptive_spec.llama.profiles import ProfileInfo
from adaptive_spec.llama.upstreams import Upstream, UpstreamTable
from adaptive_spec.proxy.app import build_app
from adaptive_spec.requests import handler, outgoing
from adaptive_spec.requests.app_keys import LIFECYCLE, ROUTER, ProxySettings
from adaptive_spec.requests.body.parse import ParsedRequest, parse_body, split_path
from adaptive_spec.requests.forwarding.outcome import SERVED
from adaptive_spec.requests.lifecycle import ProxyRequest, Routed
from adaptive_spec.routing.prompt import prefix
from adaptive_spec.routing.prompt.pieces import Piece, prompt_pieces
from adaptive_spec.sessions.backends import Work
from adaptive_spec.sessions.ngram_replay import NgramParams
from adaptive_spec.sessions.project import workspace_path_from_request
from adaptive_spec.sessions.service import SessionService
from adaptive_spec.sessions.statistics import ContextTracker
from adaptive_spec.sessions.tokenizers import CachingTokenizer, EndpointTokenizer, Tokenizer, tiktoken_o200k
from adaptive_spec.telemetry.bus import EventBus
from adaptive_spec.telemetry.records import Timings
from benchmarks.harness import results
from benchmarks.harness.agent_bodies import AgentRequest, grown, load, next_turn

NAME = "benchmarks.overhead.stages"  # the result file's `benchmark`
STAGES = (
    "read",
    "workspace",
    "group",
    "rewrite",
    "route",
    "pieces",
    "estimate",
    "upstream body",
    "finish",
    "worker loop",
    "worker thread",
    "tokenize",
)
# Parts of "route" (timed apart as well), and the work after the response: not in the request path's sum.
_NOT_SUMMED = ("workspace", "pieces", "estimate", "worker loop", "worker thread", "tokenize")
CASES = ("next", "next-noid", "first-noid", "again-noid")
_CHUNK = (
    b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":" token"}}],"created":1,"id":"chatcmpl-x",'
    b'"model":"m","system_fingerprint":"b1","object":"chat.completion.chunk","timings":{"cache_n":0,"prompt_n":10,'
    b'"prompt_ms":1.0,"prompt_per_token_ms":0.1,"prompt_per_second":1e4,"predicted_n":5,"predicted_ms":1.0,'
    b'"predicted_per_token_ms":0.2,"predicted_per_second":5e3}}\n\n'
)


# What the timed request is answered (its statistics update replays it through the counterfactual drafter).
_REPLY: tuple[str, list[str]] = ("I read the file; its functions compute values from their arguments. " * 8, [])


class _Clock:
    """Stage timings of one repetition, in ms."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}

    def time(self, stage: str, call: Callable[[], Any]) -> Any:
        started = time.perf_counter_ns()
        out = call()
        self.ms[stage] = self.ms.get(stage, 0.0) + (time.perf_counter_ns() - started) / 1e6
        return out

    async def wait(self, stage: str, call: Awaitable[Any]) -> Any:
        """An async stage, awaited (nothing else runs on this loop meanwhile)."""
        started = time.perf_counter_ns()
        out = await call
        self.ms[stage] = self.ms.get(stage, 0.0) + (time.perf_counter_ns() - started) / 1e6
        return out


class _SplitTokenizer:
    """Times the tokenizer's own thread apart from the loop (the caching layer hashes on the loop)."""

    def __init__(self, inner: Tokenizer) -> None:
        self.name, self._inner, self.ms, self.busy = inner.name, inner, 0.0, False

    async def encode(self, texts: Any) -> list[list[int]]:
        started = time.perf_counter_ns()
        self.busy = True
        try:
            return await self._inner.encode(texts)
        finally:
            self.busy = False
            self.ms += (time.perf_counter_ns() - started) / 1e6


World = tuple[web.Application, SessionService]


def _world(tokenizer: Tokenizer) -> World:
    """The proxy's app as `serve` builds it, on one profile of one slot (no server behind it: nothing is forwarded)."""
    url = "http://127.0.0.1:9"
    bus = EventBus()
    service = SessionService(ContextTracker(NgramParams()), tokenizer, publish=bus.publish)
    profile = ProfileInfo("plain", url, None, "", "", 4096, 1, None, None)
    app = build_app(UpstreamTable([Upstream("plain", url)]), ProxySettings(), service, bus=bus, profiles=[profile])
    return app, service


def _timings(tokens: int, cached: int) -> Timings:
    return Timings(prompt_n=max(1, tokens - cached), cache_n=cached, predicted_n=40, predicted_per_second=50.0)


async def _serve(
    clock: _Clock | None,
    world: World,
    agent: AgentRequest,
    raw: bytes,
    served: tuple[str, list[str]],
    prompt_tokens: int,
    cached: int,
    ids_off: bool = False,
) -> None:
    """One request through the handler's stages (timed when `clock` is given), then its statistics update. `ids_off`:
    the agent's session headers left out (its body's ids are taken out by the caller)."""
    app, service = world
    router = app[ROUTER]
    c = clock or _Clock()
    headers = {k: v for k, v in agent.headers.items() if not (ids_off and _is_session_header(k.lower()))}
    request = make_mocked_request("POST", agent.path, headers=headers, app=app)
    routed = split_path(agent.path)
    received, parsed = c.time("read", lambda: handler.read(request, routed, raw))
    assert isinstance(parsed, ParsedRequest)
    req = ProxyRequest("r" * 16, routed, "plain", client=agent.agent, received=received)
    lower = {k.lower(): v for k, v in headers.items()}
    c.time("workspace", lambda: workspace_path_from_request(lower, parsed.body))
    prepared = await c.wait("group", handler.group(request, req, parsed))
    rewrite = c.time("rewrite", lambda: handler.rewrite(request, req, prepared))
    sid = prepared.assignment.session_id if prepared.assignment is not None else None
    state = router.prefixes.get(sid)
    cache = copy.deepcopy(getattr(router.prefixes, "cache", None))  # the route below finds the cache as it was
    pieces = c.time("pieces", lambda: _pieces(parsed.body, state, cache))
    has_tools = bool(parsed.body.get("tools"))
    c.time("estimate", lambda: prefix.estimate(state, pieces, has_tools, router.chars_per_token))
    # The router computes the pieces again: on a body of its own, or Python's cached string hashes would flatter it.
    fresh = parse_body(req.routed.api, raw)
    assert isinstance(fresh, ParsedRequest)
    # A request's values are made once: the one routed is made again with them, as the handler makes it.
    req = ProxyRequest(req.request_id, routed, "plain", client=agent.agent, received=received)
    req.prepared, req.rewrite = replace(prepared, parsed=fresh), rewrite
    req.to = to = await c.wait("route", handler.route(request, req))
    assert isinstance(to, Routed)
    sent = c.time("upstream body", lambda: outgoing.upstream_body(req, to.upstream, False))
    meter = req.forwards.begin(sent)
    meter.output.add([served[0]], served[1])
    meter._take({"timings": {"prompt_n": max(1, prompt_tokens - cached), "cache_n": cached, "predicted_n": 40}})
    c.time("finish", lambda: app[LIFECYCLE].finish("POST", agent.path, req, SERVED))
    await _worker(c, service)


def _is_session_header(name: str) -> bool:
    return name in SESSION_HEADERS or name in PARENT_SESSION_HEADERS or name.endswith("-session-id")


def _without_ids(body: dict[str, Any]) -> dict[str, Any]:
    """The body without the ids a session is found by (Codex's `prompt_cache_key` and `client_metadata`, `user`)."""
    out = dict(body)
    for key in ("prompt_cache_key", "client_metadata", "user"):
        out.pop(key, None)
    if isinstance(out.get("metadata"), dict):
        out["metadata"] = {k: v for k, v in out["metadata"].items() if k not in ("session_id", "user_id")}
    return out


def _known_replies(service: SessionService, count: int = 200) -> None:
    """Other sessions' served replies, so that the reply echo has something to look through (and find nothing)."""
    for i in range(count):
        text = "\n".join(f"    other session {i} wrote line {j} of its answer here" for j in range(20))
        service.registry.note_reply(f"other{i:04d}", text, [f"call_other_{i}"])


def _pieces(body: dict[str, Any], state: prefix.PrefixState | None, cache: Any) -> tuple[Piece, ...]:
    """As the router computes them: against the session's previous pieces and the pieces made for any session's
    texts (`cache`: a copy of the router's); a full scan before those existed."""
    known = state.pieces if state is not None else ()
    try:
        return prompt_pieces(body, known, cache) if cache is not None else prompt_pieces(body, known)
    except TypeError:
        return prompt_pieces(body)


async def _worker(clock: _Clock, service: SessionService) -> None:
    """The after-response update of the request just finished: its time on the event loop and in its thread."""
    key = service._ready.get_nowait()
    work: Work = service._waiting.pop(key)
    tokenizer = service.tokenizer
    assert isinstance(tokenizer, _SplitTokenizer)
    tokenizer.ms = 0.0
    thread_ms = 0.0
    original = asyncio.to_thread

    async def timed_thread(func: Callable[..., Any], /, *args: Any) -> Any:
        nonlocal thread_ms
        inside = tokenizer.busy  # the tokenizer's own threads (hashing, encoding) are its wall time's
        started = time.perf_counter_ns()
        out = await original(func, *args)
        if not inside:
            thread_ms += (time.perf_counter_ns() - started) / 1e6
        return out

    asyncio.to_thread = timed_thread  # type: ignore[assignment]
    started = time.perf_counter_ns()
    try:
        await service._update(work)
    finally:
        asyncio.to_thread = original
        service._done(work.session_id)
        service._ready.task_done()
    total = (time.perf_counter_ns() - started) / 1e6
    # The tokenizer's wall time holds its thread's (or its HTTP calls'); the thread's other work is the plan and fold.
    clock.ms["worker loop"] = clock.ms.get("worker loop", 0.0) + max(0.0, total - thread_ms - tokenizer.ms)
    clock.ms["worker thread"] = clock.ms.get("worker thread", 0.0) + thread_ms
    clock.ms["tokenize"] = clock.ms.get("tokenize", 0.0) + tokenizer.ms


def _chunk_us(watched: bool, events: int = 200, rounds: int = 20) -> float:
    """Relay + meter of one SSE chunk as the handler does it, the meter's batch read at the end included: per chunk,
    over a stream of `events` chunks. Watched (a live view attached): llama-server's chunks carry per-token timings,
    cut out again for a client that did not ask; else they pass as they came."""
    from adaptive_spec.streams.meter import ResponseMeter
    from adaptive_spec.streams.tap import StreamTap

    chunk = _CHUNK if watched else _CHUNK[: _CHUNK.index(b',"timings"')] + b"}\n\n"
    best = float("inf")
    for _ in range(rounds):
        meter = ResponseMeter()
        tap = StreamTap(meter, strip=watched)
        started = time.perf_counter_ns()
        for i in range(events):
            tap.feed(chunk, float(i))
        tap.close()
        _ = meter.timings, meter.output.text
        best = min(best, (time.perf_counter_ns() - started) / 1e3 / events)
    return best


async def measure(
    agent: AgentRequest, tokens: int, reps: int, make_tokenizer: Callable[[], Tokenizer], case: str = "next"
) -> dict[str, Any]:
    tokenizer = make_tokenizer()  # in this event loop (an endpoint tokenizer's HTTP client belongs to it)
    ids_off = case != "next"
    body, turns = grown(agent, tokens)
    following, served = next_turn(body, turns)
    if ids_off:
        body, following = _without_ids(body), _without_ids(following)
    raw_prev, raw_next = orjson.dumps(body), orjson.dumps(following)
    count = len(raw_prev) / 3.6
    per_rep: list[dict[str, float]] = []
    for _ in range(reps + 1):
        world = _world(_SplitTokenizer(tokenizer))
        clock = _Clock()
        if case in ("first-noid", "again-noid"):
            _known_replies(world[1])
            if case == "again-noid":
                await _serve(None, world, agent, raw_prev, _REPLY, round(count), 0, ids_off=True)
            await _serve(clock, world, agent, raw_prev, served, round(count), 0, ids_off=True)
        else:
            await _serve(None, world, agent, raw_prev, served, round(count), 0, ids_off=ids_off)
            await _serve(clock, world, agent, raw_next, _REPLY, round(len(raw_next) / 3.6), round(count), ids_off)
        per_rep.append(clock.ms)
    per_rep = per_rep[1:]  # the first warms caches (the tokenizer's, the allocator's)
    while _CLIENTS:
        await _CLIENTS.pop().close()
    medians = {s: statistics.median(r.get(s, 0.0) for r in per_rep) for s in STAGES}
    request_path = sum(v for k, v in medians.items() if k not in _NOT_SUMMED)
    timed = raw_prev if case in ("first-noid", "again-noid") else raw_next
    return {
        "agent": agent.agent,
        "case": case,
        "tokenizer": tokenizer.name,
        "history_tokens": tokens,
        "body_bytes": len(timed),
        "messages": len(orjson.loads(timed).get("messages") or orjson.loads(timed).get("input") or []),
        "stages_ms": medians,
        "request_path_ms": request_path,
        "request_path_without_parse_ms": request_path - medians["read"],
        "event_loop_ms": request_path + medians["worker loop"],
    }


def memory(agent: AgentRequest, tokens: int, tokenizer: Tokenizer) -> dict[str, Any]:
    """Bytes the proxy keeps for one session after a request of this history: prefix state, grouping, statistics."""
    body, _ = grown(agent, tokens)
    raw = orjson.dumps(body)

    async def run() -> tuple[Any, ...]:
        world = _world(_SplitTokenizer(tokenizer))
        tracemalloc.start()
        await _serve(None, world, agent, raw, ("", []), round(len(raw) / 3.6), 0)
        return world

    world = asyncio.run(run())
    used, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    snap = world[1].snapshots()
    return {
        "agent": agent.agent,
        "history_tokens": tokens,
        "traced_bytes": used,
        "indexed_tokens": snap[0].indexed_tokens if snap else 0,
        "ngram_index_bytes": snap[0].memory_bytes if snap else 0,
    }


def _print(rows: list[dict[str, Any]], chunk_us: dict[str, float]) -> None:
    print(
        "\nthe proxy's own work per request, medians in ms (one SSE chunk relayed + metered, its share of the batch "
        f"read included: {chunk_us['unwatched']:.2f} µs; with a live view attached {chunk_us['watched']:.2f} µs)"
    )
    print("| agent | case | history | body KB | " + " | ".join(STAGES) + " | request path | without parse |")
    print("|---|---|---|---|" + "---|" * (len(STAGES) + 2))
    for r in rows:
        cells = " | ".join(f"{r['stages_ms'][s]:.3f}" for s in STAGES)
        print(
            f"| {r['agent']} | {r['case']} | {r['history_tokens'] // 1000}k | {r['body_bytes'] / 1024:.0f} | {cells} "
            f"| {r['request_path_ms']:.2f} | {r['request_path_without_parse_ms']:.2f} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fixtures", required=True, type=Path, help="directory of recorded agent requests")
    parser.add_argument("--sizes", default="10000,50000,100000")
    parser.add_argument("--agents", default="opencode,codex,llm,openai_sdk")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--cases", default="next", help=f"which requests to time: {', '.join(CASES)}")
    tokenizer_help = "tiktoken o200k in a thread, or a llama-server shaped /tokenize in a process of its own"
    parser.add_argument("--tokenizer", choices=("tiktoken", "endpoint"), default="tiktoken", help=tokenizer_help)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--out", default="benchmarks/results/overhead_stages.json")
    args = parser.parse_args()
    agents = load(args.fixtures)
    if not agents:
        parser.error(f"no recorded agent requests in {args.fixtures}")
    cases = args.cases.split(",")
    if unknown := set(cases) - set(CASES):
        parser.error(f"unknown --cases {', '.join(sorted(unknown))}; known: {', '.join(CASES)}")
    upstream = _tokenize_server() if args.tokenizer == "endpoint" else None
    make_tokenizer = _endpoint_tokenizer(upstream[1]) if upstream is not None else _tiktoken_tokenizer()
    sizes = [int(s) for s in args.sizes.split(",")]
    chosen = [agents[a] for a in args.agents.split(",") if a in agents]
    try:
        rows = [
            asyncio.run(measure(a, size, args.reps, make_tokenizer, case))
            for size in sizes
            for a in chosen
            for case in cases
        ]
    finally:
        if upstream is not None:
            upstream[0].terminate()
            upstream[0].join(5)
    chunk_us = {k: statistics.median(_chunk_us(k == "watched") for _ in range(5)) for k in ("unwatched", "watched")}
    _print(rows, chunk_us)
    tokenizer = CachingTokenizer(tiktoken_o200k())
    mem = [] if args.no_memory else [memory(a, size, tokenizer) for size in sizes for a in chosen]
    if mem:
        print("\nmemory per session (tracemalloc over what the proxy keeps after one request of that history)")
        print("| agent | history | traced KiB | indexed tokens | n-gram index KiB |")
        print("|---|---|---|---|---|")
        for m in mem:
            print(
                f"| {m['agent']} | {m['history_tokens'] // 1000}k | {m['traced_bytes'] / 1024:.0f} "
                f"| {m['indexed_tokens']} | {m['ngram_index_bytes'] / 1024:.0f} |"
            )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results.write(out, NAME, {"chunk_us": chunk_us, "rows": rows, "memory": mem})
    print(f"\nwritten to {out}")
    return 0


def _tiktoken_tokenizer() -> Callable[[], Tokenizer]:
    shared = CachingTokenizer(tiktoken_o200k())  # one cache for every row, as one proxy has
    return lambda: shared


def _tokenize_server() -> tuple[multiprocessing.process.BaseProcess, str]:
    """The fast fake llama-server (tests/support/fakes/fast_upstream.py), in a process of its own: its /tokenize."""
    from tests.support.fakes.fast_upstream import run as upstream_main

    port = free_port("127.0.0.1")
    proc = multiprocessing.get_context("spawn").Process(target=upstream_main, args=(port, 10), daemon=True)
    proc.start()
    for _ in range(600):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port}"


_CLIENTS: list[Any] = []  # the endpoint tokenizer's HTTP clients, closed at the end of their row


def _endpoint_tokenizer(base_url: str) -> Callable[[], Tokenizer]:
    """A fresh client and cache per row: each row's event loop has its own (asyncio.run)."""

    def make() -> Tokenizer:
        import aiohttp

        session = aiohttp.ClientSession()  # closed at the row's end (`measure`); its cache goes with it
        _CLIENTS.append(session)
        return CachingTokenizer(EndpointTokenizer(session, base_url))

    return make


if __name__ == "__main__":
    sys.exit(main())
