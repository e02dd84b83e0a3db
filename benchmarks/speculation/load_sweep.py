"""Issue 28, "Load": with several slots busy, does n-gram drafting's verification cost the other sessions' decode
steps, so that ngram-mod lowers a server's aggregate throughput?

Run:  .venv/bin/python -m benchmarks.speculation.load_sweep [--quick] [--rounds 3] [--streams 1,2,4] [--max-tokens 160]
      [--out benchmarks/results/load_sweep.json]

One patched llama-server, launched as `serve` launches the iterative profile (embedded Qwen2.5-Coder-0.5B,
`--spec-type ngram-mod` with the small-model n-match/n-min/n-max, the shipped chat template) but with
`--parallel 4 -c 16384 -t 2`, spoken to directly. For 1, 2 and 4 concurrent streams (stream i pinned to slot i) and
two workloads, every request runs once with n-gram on (the server's own types) and once off
(`"speculative.types": []`), greedy, `--max-tokens` each:

- oneshot: the shipped one-shot prompts, each its own conversation;
- edit: four edit sessions (inventory from iterative.json, todo from mixed.json, the warehouse module of
  ngram/workload.py, the tests' items file), each turn asking for the whole file back; a turn's history is the
  session's earlier turns with reference answers generated once (cached in benchmarks/results/) and replayed;
- mixed (2 and 4 streams): stream 0 an edit session, the others one-shot prompts: what one session's drafting and
  verification does to its neighbours' decode steps, which share its batches.

ngram-mod's pool is shared by all slots and keeps every n-gram it sees, prompts and drafted-for output alike, for the
server's lifetime: a request whose answer the pool has already seen drafts it whole (the same prompt's second run
with drafting accepts ~100%). So no request runs with n-gram on twice on one server, a one-shot prompt is used once
per server, an edit session's turns are used in order (a later turn's prompt holds an earlier turn's answer), and the
server is restarted when a cell round finds nothing fresh. Hence the order balance is over request sets: a cell round
takes two sets of `streams` requests and runs A(set 1) B(set 1) B(set 2) A(set 2), A = on in even rounds, off in odd
ones; each set is first prefilled (max_tokens 1, n-gram off) so that its two measured phases decode from the same
cached prompt. A phase is one concurrent wave, one request per stream; its aggregate is its output tokens over its
wall time at the client. Per request, decode speed is Σ predicted_n / Σ predicted_ms of llama-server's timings, by
stream role; acceptance is draft_n_accepted / draft_n; on and off texts of each request are compared (greedy output
should not depend on speculation). Ratios are on / off with 95% paired bootstrap intervals (bench/stats.py): over
phase pairs for the aggregate, over request pairs for decode speed.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from tests.support.prompts import EDIT as ITEMS_EDIT

from adaptive_spec.bench import machine
from adaptive_spec.bench.stats import Interval, paired_ratio, throughput, verdict
from adaptive_spec.bench.workload import Workload, parse_workload
from adaptive_spec.llama.binary.which import find_llama_server
from adaptive_spec.llama.models import DEFAULT_MODEL, EMBEDDED, embedded_chat_template, ensure_embedded
from adaptive_spec.llama.profiles import (
    SMALL_MODEL_NGRAM_MOD,
    ModelSource,
    ServerSettings,
    default_profiles,
)
from adaptive_spec.llama.speculation import Speculation
from adaptive_spec.streams.sse import SSEParser
from benchmarks.harness import ROOT, results
from benchmarks.ngram.workload import ITERATIVE_TURNS, SYSTEM_PROMPT
from benchmarks.speculation.sweep_server import SweepServer

NAME = "benchmarks.speculation.load_sweep"  # the result file's `benchmark`
WORKLOADS = ROOT / "src" / "adaptive_spec" / "bench" / "workloads"
ARMS = {"on": Speculation(), "off": Speculation(types=())}
WHOLE = " Return the complete updated file."
ITEMS_TURNS = (  # more turns for the tests' one-edit file, so that it makes a fourth session
    ITEMS_EDIT,
    "Add a docstring to `load_items` that says it reads a JSON list of objects." + WHOLE,
    "Rename the field `price_cents` of `Item` to `unit_cents` everywhere it is used." + WHOLE,
    "Make `order_total` skip items whose quantity is 0." + WHOLE,
)
CTX_MARGIN = 32  # tokens kept free in a slot beyond prompt + max_tokens (the template's tokens, rounding)
Record = dict[str, Any]
Messages = list[dict[str, str]]


@dataclass(frozen=True, slots=True)
class Unit:
    """One request: one-shot prompt `key`, or turn `turn` (0-based) of edit session `session`."""

    key: str
    session: str
    turn: int
    messages: tuple[dict[str, str], ...]


@dataclass(frozen=True, slots=True)
class EditSession:
    name: str
    system: str
    turns: tuple[tuple[str, int], ...]  # (user message, max_tokens of its reference answer)


def edit_sessions() -> list[EditSession]:
    iterative = parse_workload(json.loads((WORKLOADS / "iterative.json").read_text()), "iterative.json")
    mixed = parse_workload(json.loads((WORKLOADS / "mixed.json").read_text()), "mixed.json")

    def from_workload(work: Workload, name: str) -> EditSession:
        turns = tuple((r.user or "", r.max_tokens) for r in work.requests if r.session == name)
        return EditSession(name, work.systems[name], turns)

    return [
        from_workload(iterative, "inventory"),
        from_workload(mixed, "todo"),
        EditSession("warehouse", SYSTEM_PROMPT, tuple((t, 1400) for t in ITERATIVE_TURNS)),
        EditSession("items", iterative.systems["inventory"], tuple((t, 700) for t in ITEMS_TURNS)),
    ]


def oneshot_units() -> list[Unit]:
    work = parse_workload(json.loads((WORKLOADS / "oneshot.json").read_text()), "oneshot.json")
    units = []
    for r in work.requests:
        system = work.systems.get(r.session, "")
        head = [{"role": "system", "content": system}] if system else []
        units.append(Unit(r.session, r.session, 0, (*head, {"role": "user", "content": r.user or ""})))
    return units


def turn_messages(session: EditSession, turn: int, answers: Sequence[str]) -> Messages:
    messages = [{"role": "system", "content": session.system}]
    for (user, _), answer in zip(session.turns[:turn], answers, strict=False):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return [*messages, {"role": "user", "content": session.turns[turn][0]}]


def sweep_server(binary: str, model: Path, home: Path, log: Path) -> SweepServer:
    """The one llama-server of the sweep: the embedded 0.5B as `serve` launches the iterative profile (ngram-mod),
    with four slots and two threads."""
    settings = ServerSettings(
        model=ModelSource(path=str(model)),
        ctx_size=16384,
        threads=2,
        parallel=4,
        chat_template_file=embedded_chat_template(f"embedded:{DEFAULT_MODEL}"),
    )
    spec = default_profiles(None, SMALL_MODEL_NGRAM_MOD)[1]  # the iterative profile: ngram-mod
    return SweepServer("load-sweep", binary, spec, settings, home, log)


def body(messages: Sequence[dict[str, str]], max_tokens: int, slot: int, arm: str) -> Record:
    return {
        "messages": list(messages),
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 1,
        "stream": True,
        "cache_prompt": True,
        "id_slot": slot,
        **ARMS[arm].body_fields(),
    }


@dataclass(frozen=True, slots=True)
class Reply:
    text: str
    timings: dict[str, Any]  # the stream's last `timings`, as llama-server sent it
    finish_reason: str | None
    piece_ms: tuple[float, ...]  # when each content piece arrived, from the start of its wave


async def ask(
    http: aiohttp.ClientSession,
    server: SweepServer,
    messages: Sequence[dict[str, str]],
    max_tokens: int,
    slot: int,
    arm: str,
    started: float | None = None,
) -> Reply:
    """bench/stream.py's stream_chat, keeping every piece's arrival time: a neighbour's speed while another stream
    is still drafting needs them."""
    started = time.perf_counter() if started is None else started
    url, parser = server.url + "/v1/chat/completions", SSEParser()
    text: list[str] = []
    piece_ms: list[float] = []
    timings: dict[str, Any] = {}
    finish: str | None = None
    async with http.post(url, json=body(messages, max_tokens, slot, arm)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {(await resp.text())[:300]}")
        async for chunk in resp.content.iter_any():
            now = round((time.perf_counter() - started) * 1000, 1)
            for event in parser.feed(chunk):
                if not event.data.startswith("{"):
                    continue  # [DONE]
                obj = orjson.loads(event.data)
                for choice in obj.get("choices") or []:
                    if piece := (choice.get("delta") or {}).get("content"):
                        text.append(piece)
                        piece_ms.append(now)
                    finish = choice.get("finish_reason") or finish
                timings = obj.get("timings") or timings
    return Reply("".join(text), timings, finish, tuple(piece_ms))


async def prompt_tokens(http: aiohttp.ClientSession, server: SweepServer, messages: Messages) -> int:
    async with http.post(server.url + "/apply-template", json={"messages": messages}) as resp:
        prompt = (await resp.json())["prompt"]
    async with http.post(server.url + "/tokenize", json={"content": prompt}) as resp:
        return len((await resp.json())["tokens"])


async def slot_ctx(http: aiohttp.ClientSession, server: SweepServer) -> int:
    async with http.get(server.url + "/slots") as resp:
        return int((await resp.json())[0]["n_ctx"])


# --- reference answers for the edit sessions ------------------------------------------------------------------


def history_key(sessions: list[EditSession], n_ctx: int, max_tokens: int, server: SweepServer) -> str:
    text = json.dumps([asdict(s) for s in sessions]) + f"{EMBEDDED[DEFAULT_MODEL].sha256}{n_ctx}{max_tokens}"
    return hashlib.sha256((text + server.binary + str(server.settings.chat_template_file)).encode()).hexdigest()


async def build_session(
    http: aiohttp.ClientSession, server: SweepServer, session: EditSession, slot: int, n_ctx: int, max_tokens: int
) -> Record:
    """The session's reference answers (n-gram on: fast, and this server's pool is thrown away after), up to the
    last turn whose prompt leaves room for `max_tokens` in a slot."""
    answers: list[str] = []
    prompts: list[int] = []
    for turn, (_, reference_max) in enumerate(session.turns):
        messages = turn_messages(session, turn, answers)
        n_prompt = await prompt_tokens(http, server, messages)
        if n_prompt + max_tokens + CTX_MARGIN > n_ctx:
            break
        prompts.append(n_prompt)
        if turn + 1 < len(session.turns):
            room = min(reference_max, n_ctx - n_prompt - CTX_MARGIN)
            answers.append((await ask(http, server, messages, room, slot, "on")).text)
    print(f"  {session.name}: {len(prompts)} turns fit, prompts {prompts} tokens", flush=True)
    return {"answers": answers[: len(prompts)], "prompt_tokens": prompts}


def cached_histories(cache: Path, key: str) -> dict[str, Record] | None:
    if cache.exists():
        stored = json.loads(cache.read_text())
        if stored.get("key") == key:
            return dict(stored["sessions"])
    return None


def store_histories(cache: Path, key: str, built: dict[str, Record]) -> None:
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"key": key, "sessions": built}, indent=1) + "\n")


async def build_histories(
    http: aiohttp.ClientSession, server: SweepServer, sessions: list[EditSession], n_ctx: int, max_tokens: int
) -> dict[str, Record]:
    print("edit sessions' reference answers: generating once (n-gram on, one slot per session)", flush=True)
    built = await asyncio.gather(
        *(build_session(http, server, s, i, n_ctx, max_tokens) for i, s in enumerate(sessions))
    )
    return {s.name: b for s, b in zip(sessions, built, strict=True)}


def edit_units(sessions: list[EditSession], built: dict[str, Record]) -> dict[str, list[Unit]]:
    out: dict[str, list[Unit]] = {}
    for s in sessions:
        answers, fits = built[s.name]["answers"], len(built[s.name]["prompt_tokens"])
        out[s.name] = [Unit(f"{s.name}/{t + 1}", s.name, t, tuple(turn_messages(s, t, answers))) for t in range(fits)]
    return out


# --- what the running server's n-gram pool has seen -------------------------------------------------------------


@dataclass
class Freshness:
    """Which requests this server life can still run unspoiled: one-shot prompts not yet used, and per edit session
    the first turn not yet touched (turns only move forward)."""

    life: int = 0
    used: set[str] = field(default_factory=set)
    next_turn: dict[str, int] = field(default_factory=dict)
    cursor: int = 0  # where the next one-shot pick starts, over all lives, so all prompts get their turn

    def renew(self) -> None:
        self.life += 1
        self.used.clear()
        self.next_turn.clear()

    def oneshot(self, units: list[Unit], streams: int) -> tuple[list[Unit], list[Unit]] | None:
        order = [units[(self.cursor + i) % len(units)] for i in range(len(units))]
        fresh = [u for u in order if u.key not in self.used][: 2 * streams]
        if len(fresh) < 2 * streams:
            return None
        self.used |= {u.key for u in fresh}
        self.cursor += 2 * streams
        return fresh[:streams], fresh[streams:]

    def edit(self, units: dict[str, list[Unit]], streams: int) -> tuple[list[Unit], list[Unit]] | None:
        def start(name: str) -> int:  # a new life starts each session at a different turn, to cover them all
            return self.next_turn.get(name, (2 * self.life) % max(1, len(units[name]) - 1))

        ready = sorted((n for n in units if len(units[n]) - start(n) >= 2), key=lambda n: start(n) - len(units[n]))
        if len(ready) < streams:
            return None
        picked = ready[:streams]
        first = [units[n][start(n)] for n in picked]
        second = [units[n][start(n) + 1] for n in picked]
        for n in picked:
            self.next_turn[n] = start(n) + 2
        return first, second

    def mixed(
        self, edit: dict[str, list[Unit]], oneshot: list[Unit], streams: int
    ) -> tuple[list[Unit], list[Unit]] | None:
        """Stream 0 an edit session, the others one-shot prompts (drafting's neighbours)."""
        sessions, prompts = self.edit(edit, 1), self.oneshot(oneshot, streams - 1)
        if sessions is None or prompts is None:
            return None
        return [sessions[0][0], *prompts[0]], [sessions[1][0], *prompts[1]]


# --- measuring ---------------------------------------------------------------------------------------------------


def suite_running() -> bool:
    return subprocess.run(["pgrep", "-f", "pytest"], capture_output=True).returncode == 0


async def wave(
    http: aiohttp.ClientSession, server: SweepServer, units: list[Unit], max_tokens: int, arm: str
) -> tuple[float, list[Reply]]:
    started = time.perf_counter()
    asks = (ask(http, server, u.messages, max_tokens, i, arm, started) for i, u in enumerate(units))
    replies = await asyncio.gather(*asks)
    return (time.perf_counter() - started) * 1000, list(replies)


def request_record(unit: Unit, slot: int, reply: Reply) -> Record:
    t = reply.timings
    return {
        "key": unit.key,
        "slot": slot,
        "predicted_n": int(t.get("predicted_n", 0)),
        "predicted_ms": float(t.get("predicted_ms", 0.0)),
        "prompt_n": t.get("prompt_n"),
        "cache_n": t.get("cache_n"),
        "draft_n": int(t.get("draft_n", 0)),
        "draft_n_accepted": int(t.get("draft_n_accepted", 0)),
        "finish_reason": reply.finish_reason,
        "text": reply.text,
        "piece_ms": list(reply.piece_ms),
    }


async def cell_round(
    http: aiohttp.ClientSession,
    server: SweepServer,
    sets: tuple[list[Unit], list[Unit]],
    on_first: bool,
    max_tokens: int,
) -> list[Record]:
    """A(set 1) B(set 1) B(set 2) A(set 2), each set prefilled first."""
    first, second = ("on", "off") if on_first else ("off", "on")
    phases = []
    for n, (units, arms) in enumerate(((sets[0], (first, second)), (sets[1], (second, first))), start=1):
        await wave(http, server, units, 1, "off")
        for arm in arms:
            suite = suite_running()
            wall_ms, replies = await wave(http, server, units, max_tokens, arm)
            requests = [request_record(u, i, r) for i, (u, r) in enumerate(zip(units, replies, strict=True))]
            tokens = sum(r["predicted_n"] for r in requests)
            phases.append(
                {
                    "set": n,
                    "arm": arm,
                    "wall_ms": wall_ms,
                    "tokens": tokens,
                    "aggregate_tps": tokens / wall_ms * 1000,
                    "pytest_running": suite or suite_running(),
                    "requests": requests,
                }
            )
    return phases


async def edit_requests(
    http: aiohttp.ClientSession, server: SweepServer, history: Path, max_tokens: int
) -> tuple[int, dict[str, list[Unit]]]:
    """The slots' context and the edit sessions' turns that fit it, their reference answers cached in `history`;
    the server is left with a pool that has seen none of them."""
    sessions = edit_sessions()
    n_ctx = await slot_ctx(http, server)
    key = history_key(sessions, n_ctx, max_tokens, server)
    built = cached_histories(history, key)
    if built is None:
        built = await build_histories(http, server, sessions, n_ctx, max_tokens)
        store_histories(history, key, built)
        await server.start()
    else:
        print(f"edit sessions' reference answers: {history} (cached)")
    return n_ctx, edit_units(sessions, built)


async def sweep(args: argparse.Namespace, server: SweepServer) -> tuple[list[Record], Record]:
    # A new connection per request: llama-server closes idle keep-alive connections, which aiohttp would reuse.
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800), connector=connector) as http:
        try:
            return await measure(args, server, http)
        finally:
            await server.stop()


def cells(workload: str, streams: list[int]) -> list[int]:
    return [c for c in streams if c > 1] if workload == "mixed" else streams


async def measure(
    args: argparse.Namespace, server: SweepServer, http: aiohttp.ClientSession
) -> tuple[list[Record], Record]:
    await server.start()
    n_ctx, edit = await edit_requests(http, server, args.history, args.max_tokens)
    oneshot = oneshot_units()
    fresh, phases = Freshness(), []

    def pick(workload: str, streams: int) -> tuple[list[Unit], list[Unit]] | None:
        if workload == "mixed":
            return fresh.mixed(edit, oneshot, streams)
        return fresh.oneshot(oneshot, streams) if workload == "oneshot" else fresh.edit(edit, streams)

    for rnd in range(args.rounds):
        for workload in args.workloads:
            for streams in cells(workload, args.streams):
                sets = pick(workload, streams)
                if sets is None:  # nothing fresh left on this server: a new one, with an empty pool
                    fresh.renew()
                    await server.start()
                    sets = pick(workload, streams)
                assert sets is not None, f"{workload}: too few requests for {streams} streams"
                for p in await cell_round(http, server, sets, rnd % 2 == 0, args.max_tokens):
                    phases.append({"workload": workload, "streams": streams, "round": rnd, "life": fresh.life, **p})
                    print(_phase_line(phases[-1]), flush=True)
    turns = {n: len(u) for n, u in edit.items()}
    return phases, {"slot_ctx": n_ctx, "server_starts": server.starts, "edit_turns": turns}


def _phase_line(p: Record) -> str:
    rs = p["requests"]
    acc = f"{sum(r['draft_n_accepted'] for r in rs)}/{sum(r['draft_n'] for r in rs)}"
    keys = ",".join(r["key"] for r in rs)
    return (
        f"  r{p['round']} {p['workload']:<7} x{p['streams']} set {p['set']} {p['arm']:<3}"
        f"  {p['aggregate_tps']:6.1f} tok/s  {p['tokens']:4d} tok / {p['wall_ms'] / 1000:5.1f} s"
        f"  drafts {acc:>9}  [{keys}]" + ("  (pytest running)" if p["pytest_running"] else "")
    )


# --- summary -------------------------------------------------------------------------------------------------------


def _interval(iv: Interval | None) -> Record | None:
    return None if iv is None else {"value": iv.value, "low": iv.low, "high": iv.high, "units": iv.units}


def role(key: str) -> str:
    return "edit" if "/" in key else "oneshot"


def first_difference(a: str, b: str) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def request_figures(requests: list[Record]) -> Record:
    return {
        "request_tps": throughput([(r["predicted_n"], r["predicted_ms"]) for r in requests]),
        "request_tps_median": statistics.median(
            r["predicted_n"] / r["predicted_ms"] * 1000 for r in requests if r["predicted_ms"] > 0
        ),
        "tokens_per_request": statistics.mean(r["predicted_n"] for r in requests),
        "draft_n": sum(r["draft_n"] for r in requests),
        "draft_n_accepted": sum(r["draft_n_accepted"] for r in requests),
    }


def repeats_differ(phases: list[Record], name: str) -> tuple[int, int]:
    """(differing, compared) pairs of one request's texts in the same arm from different rounds (fresh servers): how
    often greedy output changes with nothing but the batches' timing, the baseline for on vs off."""
    texts: dict[tuple[str, str], list[str]] = {}
    for p in phases:
        for r in p["requests"]:
            if role(r["key"]) == name:
                texts.setdefault((p["arm"], r["key"]), []).append(r["text"])
    pairs = [(a, b) for runs in texts.values() for i, a in enumerate(runs) for b in runs[i + 1 :]]
    return sum(a != b for a, b in pairs), len(pairs)


def decode_ratio(pairs: list[tuple[Record, Record]]) -> Interval | None:
    """Σ predicted_n / Σ predicted_ms, on over off, paired by request."""
    return paired_ratio(
        [((a["predicted_n"], a["predicted_ms"]), (b["predicted_n"], b["predicted_ms"])) for a, b in pairs], throughput
    )


def beside_edit(phase: Record) -> list[tuple[int, float]]:
    """Each one-shot neighbour's (pieces, ms) between its first piece and its last one before stream 0, the edit
    session, finished: its decode speed while the drafting stream shared its batches."""
    edit_end = phase["requests"][0]["piece_ms"][-1]
    units = []
    for r in phase["requests"][1:]:
        ms = [t for t in r["piece_ms"] if t <= edit_end]
        units.append((len(ms) - 1, ms[-1] - ms[0]) if len(ms) >= 2 else (0, 0.0))
    return units


def neighbours(phase_pairs: list[tuple[Record, Record]]) -> Record:
    pairs = [u for on, off in phase_pairs for u in zip(beside_edit(on), beside_edit(off), strict=True)]
    ratio = paired_ratio(pairs, throughput)
    return {
        "on_tps": throughput([a for a, _ in pairs]),
        "off_tps": throughput([b for _, b in pairs]),
        "ratio": _interval(ratio),
        "verdict": "-" if ratio is None else verdict(ratio, "faster", "slower"),
    }


def cell_summary(phases: list[Record]) -> Record:
    """A cell's figures: on/off ratios paired by phase (aggregate) and by request (decode speed, per stream role)."""
    by_key = {(p["round"], p["set"], p["arm"]): p for p in phases}
    phase_pairs = [(on, by_key[(rnd, n, "off")]) for (rnd, n, arm), on in by_key.items() if arm == "on"]
    pairs = [((on["tokens"], on["wall_ms"]), (off["tokens"], off["wall_ms"])) for on, off in phase_pairs]
    request_pairs = [(a, b) for on, off in phase_pairs for a, b in zip(on["requests"], off["requests"], strict=True)]
    mismatches = []
    for a, b in request_pairs:
        at = first_difference(a["text"], b["text"])
        if at is not None:
            mismatches.append({"key": a["key"], "first_difference_char": at, "on_draft_n": a["draft_n"]})
    aggregate = paired_ratio(pairs, throughput)
    roles: Record = {}
    for name in sorted({role(a["key"]) for a, _ in request_pairs}):
        mine = [(a, b) for a, b in request_pairs if role(a["key"]) == name]
        ratio = decode_ratio(mine)
        roles[name] = {
            "requests": len(mine),
            "on": request_figures([a for a, _ in mine]),
            "off": request_figures([b for _, b in mine]),
            "ratio": _interval(ratio),
            "verdict": "-" if ratio is None else verdict(ratio, "faster", "slower"),
            "repeats_differ": repeats_differ(phases, name),
        }
    on_all = request_figures([a for a, _ in request_pairs])
    return {
        "workload": phases[0]["workload"],
        "streams": phases[0]["streams"],
        "rounds": len({p["round"] for p in phases}),
        "phase_pairs": len(pairs),
        "aggregate_tps_median": {
            a: statistics.median(p["aggregate_tps"] for p in phases if p["arm"] == a) for a in ARMS
        },
        "aggregate_ratio": _interval(aggregate),
        "verdict": "-" if aggregate is None else verdict(aggregate, "n-gram helps", "n-gram hurts"),
        "request_ratio": _interval(decode_ratio(request_pairs)),
        "roles": roles,
        "neighbours_beside_edit": neighbours(phase_pairs) if phases[0]["workload"] == "mixed" else None,
        "draft_n": on_all["draft_n"],
        "draft_n_accepted": on_all["draft_n_accepted"],
        "compared": len(request_pairs),
        "mismatches": mismatches,
        "pytest_seen": any(p["pytest_running"] for p in phases),
    }


def _ratio(iv: Record | None) -> str:
    return "-" if iv is None else f"{iv['value']:.3f} [{iv['low']:.3f}, {iv['high']:.3f}]"


def _acceptance(f: Record) -> str:
    return (
        f"{f['draft_n_accepted']}/{f['draft_n']} ({f['draft_n_accepted'] / f['draft_n']:.0%})"
        if f["draft_n"]
        else "0/0"
    )


def table(rows: list[Record]) -> str:
    lines = [
        "| workload | streams | agg tok/s on | agg tok/s off | agg on/off [95%] | verdict (aggregate) | stream role "
        "| req tok/s on | req tok/s off | req on/off [95%] | accepted/drafted | text on≠off | same arm, other round |",
        "|---|---:|---:|---:|---|---|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        verdict_text = r["verdict"].replace("indistinguishable", "no detectable difference")
        head = (
            f"| {r['workload']} | {r['streams']} | {r['aggregate_tps_median']['on']:.1f}"
            f" | {r['aggregate_tps_median']['off']:.1f} | {_ratio(r['aggregate_ratio'])}"
            f" | {verdict_text}{' (pytest seen)' if r['pytest_seen'] else ''}"
        )
        for i, (name, f) in enumerate(r["roles"].items()):
            lead = head if i == 0 else "| | | | | | "
            wrong = sum(1 for m in r["mismatches"] if role(m["key"]) == name)
            lines.append(
                f"{lead} | {name} | {f['on']['request_tps']:.1f} | {f['off']['request_tps']:.1f} | {_ratio(f['ratio'])}"
                f" | {_acceptance(f['on'])} | {wrong}/{f['requests']}"
                f" | {f['repeats_differ'][0]}/{f['repeats_differ'][1]} |"
            )
    for r in rows:
        if r["neighbours_beside_edit"]:
            n = r["neighbours_beside_edit"]
            lines.append(
                f"\nmixed x{r['streams']}: one-shot neighbours' decode while the edit stream still runs:"
                f" on {n['on_tps']:.1f} tok/s, off {n['off_tps']:.1f} tok/s,"
                f" on/off {_ratio(n['ratio'])} ({n['verdict']})"
            )
    return "\n".join(lines)


def summarize(phases: list[Record]) -> list[Record]:
    cells_seen = list(dict.fromkeys((p["workload"], p["streams"]) for p in phases))
    return [cell_summary([p for p in phases if (p["workload"], p["streams"]) == cell]) for cell in cells_seen]


def report(result: Record, out: Path) -> None:
    rows = summarize(result["phases"])
    print()
    print(table(rows))
    print(
        f"({result['note']}; ratios on/off with 95% paired bootstrap intervals: phases for aggregate, requests for req)"
    )
    print(
        f"wall time {result['wall_s']:.0f} s; server starts {result['server_starts']};"
        f" machine: {result['load_warning'] or 'steady'}"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    results.write(out, NAME, {**result, "rows": rows})
    print(f"written: {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 round, 1 and 2 streams: a check that it runs")
    parser.add_argument("--rounds", type=int, default=3, help="about 4 to 5 minutes each on 2 cores")
    parser.add_argument("--streams", default="1,2,4")
    parser.add_argument("--workloads", default="oneshot,edit,mixed")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/load_sweep.json")
    parser.add_argument("--history", type=Path, default=ROOT / "benchmarks/results/load_sweep_history.json")
    parser.add_argument("--resummarize", action="store_true", help="redo --out's table from its phases, no run")
    args = parser.parse_args()
    if args.resummarize:
        report(json.loads(args.out.read_text()), args.out)
        return
    args.streams = [1, 2] if args.quick else [int(s) for s in args.streams.split(",")]
    args.rounds = 1 if args.quick else args.rounds
    args.workloads = args.workloads.split(",")
    binary, model = find_llama_server(None), ensure_embedded(DEFAULT_MODEL, print)
    started, load_start = time.monotonic(), machine.sample()
    with tempfile.TemporaryDirectory() as tmp:
        log = args.out.with_name(args.out.stem + "_llama-server.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        log.unlink(missing_ok=True)
        server = sweep_server(binary, model, Path(tmp), log)
        print("llama-server:", " ".join(server.argv))
        phases, meta = asyncio.run(sweep(args, server))
    wall_s, load_end = time.monotonic() - started, machine.sample()
    note = (
        f"{os.cpu_count()} cores, one llama-server -t 2 --parallel 4 -c 16384 shared by all streams; greedy,"
        f" max_tokens {args.max_tokens}; {args.rounds} rounds; aggregate = a phase's output tokens / its wall time"
        " (median over phases); req = Σ predicted_n / Σ predicted_ms of llama-server's timings"
    )
    result = {
        "note": note,
        "command": " ".join([sys.executable, *sys.argv]),
        "argv": server.argv,
        "wall_s": wall_s,
        "load_start": asdict(load_start),
        "load_end": asdict(load_end),
        "load_warning": machine.judge(load_start, load_end),
        **meta,
        "phases": phases,
    }
    report(result, args.out)


if __name__ == "__main__":
    main()
