"""`adaptive-spec bench`: the same workloads, greedy, in the same order, on every profile of a running proxy (pinned)
and, with --adaptive, on its own route; one table per workload, plus CSV, JSON and a PNG chart.

Inputs stay the same across targets: each target runs the workload in its own pass, and the reply that joins a
session's history is always the first target's. Known state: before each pass every launched profile is restarted
(llama-server offers no call to empty its n-gram pool, and a later pass would find the earlier passes' greedy answers
in it), and each pass's system prompts start with a tag of their own. Attached profiles can only have their slots
erased (through the proxy's POST /adaptive/profiles/NAME/erase); the bench says so. The oracle is computed from the
static passes: per request, the one that decoded it fastest.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from dataclasses import asdict
from importlib import resources
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from adaptive_spec.bench.stream import stream_chat
from adaptive_spec.bench.table import ReportRow, baseline_profile, summarize, to_csv, to_markdown
from adaptive_spec.bench.workload import Replay, Workload, WorkloadRequest, parse_workload, workload_from_trace
from adaptive_spec.core.headers import PROFILE_HEADER, SESSION_ID_HEADER
from adaptive_spec.errors import ConfigError

BUILTIN = ("iterative", "oneshot", "mixed")
ADAPTIVE = "adaptive"
ORACLE = "oracle"  # per request, the static profile that decoded it fastest (computed from the static passes)


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


async def _known_state(session: aiohttp.ClientSession, base: str, profiles: list[str], say: Any) -> None:
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
        say(f"\nprofile {name!r} is attached: its slots are erased, its n-gram pool carries over to the next pass")
        async with session.post(f"{base}/adaptive/profiles/{name}/erase") as resp:
            text = await resp.text()
            if resp.status != 200:
                say(f"profile {name!r}: erasing its slots failed (HTTP {resp.status}): {text[:300]}")


Records = dict[str, list[dict[str, Any]]]


async def run_bench(
    base: str,
    workloads: list[Workload],
    profiles: list[str] | None,
    adaptive: bool,
    max_tokens: int | None,
    say: Any,
    repeat: int = 1,
) -> tuple[Records, list[dict[str, Any]]]:
    """Records per workload, and the profiles the proxy reported; stops cleanly on cancellation (Ctrl-C).

    `repeat` runs every target's pass that many times, alternating targets and their order (A B C C B A ...), so
    slow spells of a shared machine fall on every target alike."""
    records: dict[str, list[dict[str, Any]]] = {}
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
        total = sum(len(w.requests) for w in workloads) * len(targets) * repeat
        done = 0
        try:
            for workload in workloads:
                rows = records.setdefault(workload.name, [])
                replies: dict[int, str] = {}  # the first target's replies: every later pass sees the same history
                # Round r runs the targets in order, round r+1 in reverse (A B C C B A ...): neither a drift of the
                # machine's speed nor being first after a restart favours one target.
                order = [(r, t) for r in range(repeat) for t in (targets if r % 2 == 0 else targets[::-1])]
                for round_, target in order:
                    # One pass per target, from a known state: fresh servers, so no target inherits another's KV
                    # cache, prompt cache or n-gram pool.
                    await _known_state(session, base, names, say)
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
                        say(f"\r[{done}/{total}] {workload.name}: request {request.index + 1} on {target}   ", end="")
        except asyncio.CancelledError:
            say("\ninterrupted: keeping what finished")
        say("")
    return records, known


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


def _decode_s_per_token(record: dict[str, Any]) -> float:
    t = record.get("timings") or {}
    n = int(t.get("predicted_n", 0))
    return float(t.get("predicted_ms", 0.0)) / n if n else float("inf")


def with_oracle(recs: list[dict[str, Any]], statics: list[str]) -> list[dict[str, Any]]:
    """The records plus an `oracle` pass: per request, the static profile's record that decoded it fastest."""
    by_index: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in recs:
        if r.get("profile") in statics and r.get("outcome") == "finished" and "index" in r:
            by_index.setdefault((int(r["index"]), int(r.get("round", 0))), []).append(r)
    complete = [rows for rows in by_index.values() if len(rows) == len(statics)]
    if len(statics) < 2 or not complete:
        return recs
    best = [min(rows, key=_decode_s_per_token) for rows in complete]
    return recs + [{**r, "profile": ORACLE, "served_profile": r["profile"], "session_id": None} for r in best]


def comparison(rows: list[ReportRow], statics: list[str]) -> str | None:
    """Adaptive against the better static profile (throughput and median TTST) and against the oracle."""
    by = {r.name: r for r in rows}
    adaptive, oracle = by.get(ADAPTIVE), by.get(ORACLE)
    static_rows = [by[s] for s in statics if s in by]
    if adaptive is None or not static_rows:
        return None
    best_speed = max(static_rows, key=lambda r: r.decode_tok_s)
    best_ttst = min(static_rows, key=lambda r: r.ttst_ms_median or float("inf"))
    parts = [f"adaptive: {adaptive.decode_tok_s / best_speed.decode_tok_s:.3f}× the throughput of {best_speed.name}"]
    if adaptive.ttst_ms_median and best_ttst.ttst_ms_median:
        parts.append(f"{adaptive.ttst_ms_median / best_ttst.ttst_ms_median:.3f}× the median TTST of {best_ttst.name}")
    if oracle is not None and oracle.decode_tok_s:
        parts.append(f"{adaptive.decode_tok_s / oracle.decode_tok_s:.3f}× the oracle's throughput")
    for r in static_rows:
        if r.ttst_ms_median and adaptive.ttst_ms_median:
            parts.append(
                f"vs {r.name}: {adaptive.decode_tok_s / r.decode_tok_s:.3f}× tok/s, "
                f"{adaptive.ttst_ms_median / r.ttst_ms_median:.3f}× TTST"
            )
    return "; ".join(parts)


def write_outputs(records: dict[str, list[dict[str, Any]]], known: list[dict[str, Any]], out: Path | None) -> str:
    baseline = baseline_profile(known)
    tables, flat = [], []
    for name, recs in records.items():
        statics = [p for p in dict.fromkeys(str(r.get("profile")) for r in recs) if p not in (ADAPTIVE, ORACLE)]
        recs = records[name] = with_oracle(recs, statics)
        rows: list[ReportRow] = summarize(recs, baseline)
        rows = [r for r in rows if r.name != "all (as routed)"]
        compared = comparison(rows, statics)
        tables.append(f"workload: {name}\n" + to_markdown(rows, baseline) + (f"\n\n{compared}" if compared else ""))
        flat += [{"workload": name, **asdict(r)} for r in rows]
    text = "\n\n".join(tables)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_bytes(
            orjson.dumps({"baseline": baseline, "rows": flat, "records": records}, option=orjson.OPT_INDENT_2)
        )
        header = "workload," + to_csv([]).strip()
        lines = [header] + [
            f"{w}," + to_csv([r]).splitlines()[1]
            for w, recs in records.items()
            for r in summarize(recs, baseline)
            if r.name != "all (as routed)"
        ]
        (out / "bench.csv").write_text("\n".join(lines) + "\n")
        (out / "bench.md").write_text(text + "\n")
        _chart(flat, out / "bench.png")
    return text


def _chart(rows: list[dict[str, Any]], path: Path) -> None:
    """Grouped bars: decode tok/s per workload, one bar per profile."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    profiles = list(dict.fromkeys(r["name"] for r in rows))
    width = 0.8 / max(1, len(profiles))
    fig, ax = plt.subplots(figsize=(max(6, 2.5 * len(workloads)), 4), constrained_layout=True)
    for i, profile in enumerate(profiles):
        values = [
            next((r["decode_tok_s"] for r in rows if r["workload"] == w and r["name"] == profile), 0.0)
            for w in workloads
        ]
        ax.bar([x + (i - (len(profiles) - 1) / 2) * width for x in range(len(workloads))], values, width, label=profile)
    ax.set_xticks(list(range(len(workloads))), workloads)
    ax.set_ylabel("decode tok/s (aggregate)")
    ax.legend()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main_bench(
    url: str,
    specs: list[str],
    profiles: list[str] | None,
    adaptive: bool,
    out: Path | None,
    max_tokens: int | None,
    repeat: int = 1,
) -> str:
    workloads = [load_workload(s) for s in specs]

    def say(message: str, end: str = "\n") -> None:
        print(message, end=end, file=sys.stderr, flush=True)

    records: dict[str, list[dict[str, Any]]] = {}
    known: list[dict[str, Any]] = []

    async def go() -> None:
        nonlocal records, known
        records, known = await run_bench(url.rstrip("/"), workloads, profiles, adaptive, max_tokens, say, repeat)

    try:
        asyncio.run(go())
    finally:
        if records:
            print(write_outputs(records, known, out))
            random = sorted({str(p["model"]) for p in known if "random" in str(p.get("model") or "")})
            if random:  # a model file named *random*, as the test suite names its random-weight models
                print(f"\ncaveat: {', '.join(random)}: random weights, so these figures measure plumbing, not speed")
    return ""


def main_simulate(scenario_name: str, specs: list[str], out: Path | None) -> str:
    """`bench --simulate`: the routing policy replayed at a scenario's speeds, on the public benchmark's mix and on
    the given (or built-in) workloads; no proxy, no model."""
    from adaptive_spec.bench.simulator import SCENARIOS, public_mix, requests_from_workload, simulate_targets
    from adaptive_spec.bench.simulator import to_markdown as sim_markdown

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
