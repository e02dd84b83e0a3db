"""`adaptive-spec bench`: the same workloads, greedy, in the same order, on every profile of a running proxy (pinned)
and, with --adaptive, on its own route; one table per workload, plus CSV, JSON and a PNG chart.

Inputs stay the same across targets: each target runs the workload in its own pass, and the reply that joins a
session's history is always the first target's. Known state: before each pass every launched server is restarted,
once whichever profiles it serves (llama-server offers no call to empty its n-gram pool, and a later pass would find
the earlier passes' greedy answers in it), and each pass's system prompts start with a tag of their own. Attached
profiles can only have their slots erased (through the proxy's POST /adaptive/profiles/NAME/erase); the bench says
so. Every ratio comes with a 95%
interval and a verdict (bench/compare.py, bench/stats.py); the machine's load is sampled around every pass
(bench/machine.py).
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from dataclasses import asdict
from importlib import resources
from pathlib import Path
from typing import Any, TextIO

import aiohttp
import orjson

from adaptive_spec.bench import compare, machine
from adaptive_spec.bench.chart import chart
from adaptive_spec.bench.compare import ADAPTIVE, REFERENCES
from adaptive_spec.bench.progress import Progress
from adaptive_spec.bench.stream import stream_chat
from adaptive_spec.bench.table import ReportRow, baseline_profile, summarize, to_csv, to_markdown
from adaptive_spec.bench.workload import Replay, Workload, WorkloadRequest, parse_workload, workload_from_trace
from adaptive_spec.common.headers import PROFILE_HEADER, SESSION_ID_HEADER
from adaptive_spec.errors import ConfigError

BUILTIN = ("iterative", "oneshot", "mixed", "prose")
REPEAT = 2  # order-balanced: A B C, then C B A


def load_workload(spec: str) -> Workload:
    """A built-in workload by name, or a workload file."""
    if spec in BUILTIN:
        text = resources.files("adaptive_spec.bench.workloads").joinpath(f"{spec}.json").read_bytes()
        source = f"{spec} (built in)"
    else:
        try:
            text = Path(spec).read_bytes()
        except OSError as exc:
            raise ConfigError(f"--workload {spec!r}: not one of {', '.join(BUILTIN)} and not readable: {exc}") from exc
        source = spec
    first = text.lstrip().split(b"\n", 1)[0]
    if first.startswith(b"{") and b'"kind"' in first:  # a trace from `serve --trace --trace-content`
        try:
            lines = [orjson.loads(line) for line in text.splitlines() if line.strip()]
        except orjson.JSONDecodeError as exc:
            raise ConfigError(f"{source}: not a trace of JSON lines: {exc}") from exc
        return parse_workload(workload_from_trace(lines, Path(spec).stem), source)
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"{source}: not valid JSON: {exc}") from exc
    return parse_workload(obj, source)


async def _stream(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any], headers: dict[str, str]
) -> dict[str, Any]:
    """One streamed request, timed at the client; returns a record shaped like /adaptive/requests'."""
    reply = await stream_chat(session, url, body, headers)
    return {
        "timings": reply.timings,
        "ttft_ms": reply.ttft_ms,
        "ttst_ms": reply.ttst_ms,
        "total_ms": reply.total_ms,
        "outcome": "finished" if reply.timings else "failed",
        "text": reply.text,
        "served_profile": reply.served_profile,
        "route": reply.route,
    }


def one_per_server(profiles: list[dict[str, Any]]) -> list[str]:
    """One profile per llama-server (the first named for each URL and router preset): profiles that are per-request
    settings of one server share it, and restarting it once empties it for all of them."""
    seen: dict[tuple[str, str], str] = {}
    for p in profiles:
        seen.setdefault((str(p.get("base_url")), str(p.get("preset"))), str(p["name"]))
    return list(seen.values())


async def _known_state(session: aiohttp.ClientSession, base: str, profiles: list[str], progress: Progress) -> None:
    """Each pass starts from fresh servers: a launched profile is restarted (empty KV cache, RAM prompt cache and
    n-gram pool); an attached one can only have its slots erased (by the proxy, which owns them), and its n-gram
    pool carries over."""
    for name in profiles:
        async with session.post(f"{base}/adaptive/profiles/{name}/restart") as resp:
            await resp.read()
            if resp.status == 200:
                continue
            if resp.status != 409:
                raise ConfigError(f"restarting profile {name!r} failed: HTTP {resp.status}")
        progress.note(
            f"profile {name!r} is attached: its slots are erased, its n-gram pool carries over to later passes"
        )
        async with session.post(f"{base}/adaptive/profiles/{name}/erase") as resp:
            text = await resp.text()
            if resp.status != 200:
                progress.note(f"profile {name!r}: erasing its slots failed (HTTP {resp.status}): {text[:300]}")


Records = dict[str, list[dict[str, Any]]]


async def _pass_starts(workload: str, target: str, round_: int) -> tuple[dict[str, Any], machine.LoadSample]:
    """The machine's load as a pass starts (sampled in a thread: a sample waits a second)."""
    start = await asyncio.to_thread(machine.sample)
    passed: dict[str, Any] = {"workload": workload, "target": target, "round": round_, "start": asdict(start)}
    return passed, start


async def _pass_ends(passed: dict[str, Any], start: machine.LoadSample, progress: Progress) -> None:
    end = await asyncio.to_thread(machine.sample)
    passed["end"] = asdict(end)
    passed["warning"] = machine.judge(start, end)
    if passed["warning"]:
        where = f"{passed['workload']} on {passed['target']} (round {passed['round'] + 1})"
        progress.note(f"warning: {where}: {passed['warning']}")


async def run_bench(
    base: str,
    workloads: list[Workload],
    profiles: list[str] | None,
    adaptive: bool,
    max_tokens: int | None,
    stream: TextIO,
    repeat: int = REPEAT,
) -> tuple[Records, list[dict[str, Any]], list[dict[str, Any]]]:
    """Records per workload, the profiles the proxy reported, and the machine's load around each pass; stops cleanly
    on cancellation (Ctrl-C).

    `repeat` runs every target's pass that many times, alternating targets and their order (A B C C B A ...), so
    slow spells of a shared machine fall on every target alike."""
    records: dict[str, list[dict[str, Any]]] = {}
    passes: list[dict[str, Any]] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=1800)
    key = os.environ.get("ADAPTIVE_SPEC_API_KEY", "").strip()  # the proxy's key, when it asks for one
    headers = {"Authorization": f"Bearer {key}"} if key else None
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        async with session.get(f"{base}/adaptive/profiles") as resp:
            known = (await resp.json())["profiles"]
        names = [p["name"] for p in known]
        chosen = profiles or names
        unknown = set(chosen) - set(names)
        if unknown:
            raise ConfigError(f"--profiles: {', '.join(sorted(unknown))} not served; the proxy has {', '.join(names)}")
        targets = [*([ADAPTIVE] if adaptive else []), *chosen]
        progress = Progress(stream, sum(len(w.requests) for w in workloads) * len(targets) * repeat, stream.isatty())
        done = 0
        try:
            for workload in workloads:
                rows = records.setdefault(workload.name, [])
                replies: dict[int, str] = {}  # the first target's replies: every later pass sees the same history
                # Round r runs the targets in order, round r+1 in reverse (A B C C B A ...): neither a drift of the
                # machine's speed nor being first after a restart favours one target.
                order = [(r, t) for r in range(repeat) for t in (targets if r % 2 == 0 else targets[::-1])]
                for round_, target in order:
                    # Sampled while the servers are idle, before their restarts: the load is other processes'.
                    passed, start = await _pass_starts(workload.name, target, round_)
                    passes.append(passed)
                    # One pass per target, from a known state: fresh servers, so no target inherits another's KV
                    # cache, prompt cache or n-gram pool.
                    await _known_state(session, base, one_per_server(known), progress)
                    replay = Replay(workload, tag=f"bench pass {target} {round_}")
                    for request in workload.requests:
                        result = await _one(session, base, workload, replay, request, target, max_tokens)
                        text = result.pop("text")
                        result["round"] = round_
                        if round_:  # sessions of a later round are sessions of their own
                            result["session_id"] = f"{result['session_id']}-r{round_}"
                        rows.append(result)
                        replay.keep_reply(request, replies.setdefault(request.index, text))
                        done += 1
                        progress.step(done, f"{workload.name}: request {request.index + 1} on {target}")
                    await _pass_ends(passed, start, progress)
        except asyncio.CancelledError:
            progress.note("interrupted: keeping what finished")
        progress.close()
    return records, known, passes


async def _one(
    session: aiohttp.ClientSession,
    base: str,
    workload: Workload,
    replay: Replay,
    request: WorkloadRequest,
    target: str,
    max_tokens: int | None,
) -> dict[str, Any]:
    body = {
        "model": "bench",
        "messages": replay.messages_for(request),
        "temperature": 0,
        "seed": 1,
        "stream": True,
        "max_tokens": min(request.max_tokens, max_tokens) if max_tokens else request.max_tokens,
    }
    session_id = f"bench-{workload.name}-{request.session}-{target}"
    headers = {SESSION_ID_HEADER: session_id}
    if target != ADAPTIVE:
        headers[PROFILE_HEADER] = target
    result = await _stream(session, f"{base}/p/bench/v1/chat/completions", body, headers)
    result.update(
        profile=target, session_id=session_id, started_at_unix=time.time(), workload=workload.name, index=request.index
    )
    return result


def write_outputs(
    records: dict[str, list[dict[str, Any]]],
    known: list[dict[str, Any]],
    out: Path | None,
    passes: list[dict[str, Any]] | None = None,
) -> str:
    """The tables and verdicts as text; with `out`, bench.json (rows, intervals, verdicts, load, records), bench.csv,
    bench.md and bench.png."""
    baseline = baseline_profile(known)
    tables, flat, verdicts, intervals = [], [], [], []
    for name, recs in records.items():
        statics = [p for p in dict.fromkeys(str(r.get("profile")) for r in recs) if p not in (ADAPTIVE, *REFERENCES)]
        recs = records[name] = compare.with_references(recs, statics)
        rows: list[ReportRow] = [r for r in summarize(recs, baseline) if r.name != "all (as routed)"]
        per_target = compare.target_intervals(recs, baseline)
        vs_base = {t.name: t.vs_baseline for t in per_target if t.vs_baseline is not None}
        found = compare.comparisons(recs, statics)
        lines = [compare.describe(c) for c in found]
        best = compare.describe_best(recs, statics)
        lines += [best] if best is not None else []
        table = to_markdown(rows, baseline, vs_base)
        tables.append(f"workload: {name}\n{table}" + "".join(f"\n{x}" for x in ["", *lines]))
        flat += [{"workload": name, **asdict(r)} for r in rows]
        verdicts += [{"workload": name, **compare.as_json(c)} for c in found]
        intervals += [{"workload": name, **asdict(t)} for t in per_target]
    text = "\n\n".join(tables)
    if records and not any(r.get("round", 0) for recs in records.values() for r in recs):
        text += "\n\nnote: one round only (--repeat 1): the intervals cover request-to-request spread, not a slow spell"
    warned = [p for p in passes or [] if p.get("warning")]
    if warned:
        text += (
            f"\n\nwarning: other work on the machine may have moved the figures of {len(warned)} pass(es): "
            "see bench.json 'load'"
        )
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        result = {
            "baseline": baseline,
            "rows": flat,
            "intervals": intervals,
            "verdicts": verdicts,
            "load": passes or [],
            "records": records,
        }
        (out / "bench.json").write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))
        header = "workload," + to_csv([]).strip()
        csv_lines = [header] + [f"{r['workload']}," + to_csv([_report_row(r)]).splitlines()[1] for r in flat]
        (out / "bench.csv").write_text("\n".join(csv_lines) + "\n")
        (out / "bench.md").write_text(text + "\n")
        chart(flat, intervals, baseline, out / "bench.png")
    return text


def _report_row(row: dict[str, Any]) -> ReportRow:
    return ReportRow(**{k: v for k, v in row.items() if k != "workload"})


def main_bench(
    url: str,
    specs: list[str],
    profiles: list[str] | None,
    adaptive: bool,
    out: Path | None,
    max_tokens: int | None,
    repeat: int = REPEAT,
) -> str:
    workloads = [load_workload(s) for s in specs]
    records: dict[str, list[dict[str, Any]]] = {}
    known: list[dict[str, Any]] = []
    passes: list[dict[str, Any]] = []

    async def go() -> None:
        nonlocal records, known, passes
        base = url.rstrip("/")
        records, known, passes = await run_bench(base, workloads, profiles, adaptive, max_tokens, sys.stderr, repeat)

    try:
        asyncio.run(go())
    finally:
        if records:
            print(write_outputs(records, known, out, passes))
            random = sorted({str(p["model"]) for p in known if "random" in str(p.get("model") or "")})
            if random:  # a model file named *random*, as the test suite names its random-weight models
                print(f"\ncaveat: {', '.join(random)}: random weights, so these figures measure plumbing, not speed")
    return ""


def main_simulate(scenario_name: str, specs: list[str], out: Path | None) -> str:
    """`bench --simulate`: the routing policy replayed at a scenario's speeds, on the public benchmark's mix and on
    the given (or built-in) workloads; no proxy, no model."""
    from adaptive_spec.bench.simulate.routing import SCENARIOS, public_mix, requests_from_workload, simulate_targets
    from adaptive_spec.bench.simulate.routing import to_markdown as sim_markdown

    if scenario_name in ("pp-remote", "pool"):
        return _simulate_scale(scenario_name, specs, out)
    scenario = SCENARIOS[scenario_name]
    runs = [("public benchmark mix (18-turn edit session + 100 one-shot prompts, 50/50 tokens)", public_mix())]
    runs += [(w.name, requests_from_workload(w)) for w in (load_workload(s) for s in specs or BUILTIN)]
    tables, rows = [], []
    for name, requests in runs:
        result = simulate_targets(requests, scenario)
        tables.append(sim_markdown(result, scenario, name))
        rows += [{"workload": name, **asdict(r)} for r in result]
    text = "\n\n".join(tables)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"simulate-{scenario.name}.md").write_text(text + "\n")
        (out / f"simulate-{scenario.name}.json").write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2))
    return text


def _simulate_scale(name: str, specs: list[str], out: Path | None) -> str:
    """The arithmetic beyond one machine: remote prefill (`pp-remote`), a pool of replicas (`pool`, on the sessions
    of the given workloads, `mixed` by default)."""
    from adaptive_spec.bench.simulate.pool import pool_tables
    from adaptive_spec.bench.simulate.remote import remote_tables
    from adaptive_spec.bench.simulate.routing import SimRequest, requests_from_workload

    if name == "pp-remote":
        text = remote_tables()
    else:
        workloads = [load_workload(s) for s in specs or ["mixed"]]
        templates: list[list[SimRequest]] = []
        for w in workloads:
            by_session: dict[str, list[SimRequest]] = {}
            for r in requests_from_workload(w):
                by_session.setdefault(r.session, []).append(r)
            templates += by_session.values()
        text = pool_tables(templates, ", ".join(w.name for w in workloads))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"simulate-{name}.md").write_text(text + "\n")
    return text
