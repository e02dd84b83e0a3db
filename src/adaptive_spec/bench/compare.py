"""The bench's reference rows and its verdicts: adaptive against each static profile and the references, every ratio
with a 95% interval (bench/stats.py).

Pure: records in, values and text out.

Two references are built from the passes (docs/benchmarks.md, "Routing: what this machine can show"):

- "best static per request": per request, the static pass that decoded it fastest. It is NOT an upper bound on the
  adaptive route. Each static pass runs the whole workload on one server with one slot, so interleaved sessions
  evict each other's KV cache and every n-gram pool sees all the traffic; the adaptive route splits the traffic over
  the servers, each keeps its own sessions' cache and pool, so it can beat this reference without routing better.
- "best seen per request": per request, the fastest decode and the shortest time to the second token of ANY pass,
  the adaptive one included, at the adaptive pass's token count. This one holds: no route between these targets,
  in the states this run saw, did better, so adaptive / best seen <= 1 by construction, and the gap is what better
  routing could still have won.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from adaptive_spec.bench import stats

ADAPTIVE = "adaptive"
BEST_STATIC = "best static per request"
BEST_SEEN = "best seen per request"
REFERENCES = (BEST_STATIC, BEST_SEEN)

Record = Mapping[str, Any]
Key = tuple[int, int]  # (request index, round)


def _key(record: Record) -> Key:
    return int(record["index"]), int(record.get("round", 0))


def _finished(record: Record) -> bool:
    return record.get("outcome") == "finished" and bool(record.get("timings")) and "index" in record


def _ms_per_token(record: Record) -> float:
    t = record.get("timings") or {}
    n = int(t.get("predicted_n", 0))
    return float(t.get("predicted_ms", 0.0)) / n if n else float("inf")


def _by_key(records: Sequence[Record], profile: str) -> dict[Key, Record]:
    return {_key(r): r for r in records if r.get("profile") == profile and _finished(r)}


def with_references(records: list[dict[str, Any]], statics: list[str]) -> list[dict[str, Any]]:
    """The records plus the reference passes, for requests every static (and the adaptive pass) finished."""
    passes = {p: _by_key(records, p) for p in statics}
    keys = set.intersection(*(set(v) for v in passes.values())) if len(statics) >= 2 else set()
    extra: list[dict[str, Any]] = []
    for key in sorted(keys):
        best = min((passes[p][key] for p in statics), key=_ms_per_token)
        extra.append({**best, "profile": BEST_STATIC, "served_profile": best["profile"], "session_id": None})
    adaptive = _by_key(records, ADAPTIVE)
    for key in sorted(keys & set(adaptive)):
        seen = [adaptive[key], *(passes[p][key] for p in statics)]
        fastest = min(seen, key=_ms_per_token)
        n = int(adaptive[key]["timings"].get("predicted_n", 0))
        ttsts = [float(r["ttst_ms"]) for r in seen if r.get("ttst_ms") is not None]
        # At the adaptive pass's token count, so its aggregate speed cannot exceed this row's; the draft share is
        # the fastest pass's.
        t = fastest["timings"]
        share = int(t.get("draft_n_accepted", 0)) / max(1, int(t.get("predicted_n", 0)))
        ms = n * _ms_per_token(fastest)
        timings = {
            "predicted_n": n,
            "predicted_ms": ms,
            "predicted_per_second": n / ms * 1000 if ms else 0.0,
            "draft_n_accepted": round(share * n),
        }
        extra.append(
            {
                "profile": BEST_SEEN,
                "served_profile": fastest["profile"],
                "session_id": None,
                "outcome": "finished",
                "index": key[0],
                "round": key[1],
                "timings": timings,
                "ttft_ms": None,
                "ttst_ms": min(ttsts) if ttsts else None,
                "total_ms": None,
            }
        )
    return records + extra


def _speed_unit(r: Record) -> tuple[float, float]:
    t = r["timings"]
    return float(t.get("predicted_n", 0)), float(t.get("predicted_ms", 0.0))


def _drafts_unit(r: Record) -> tuple[float, float]:
    t = r["timings"]
    return float(t.get("draft_n_accepted", 0)), float(t.get("predicted_n", 0))


def _share(units: Sequence[tuple[float, float]]) -> float:
    whole = sum(u[1] for u in units)
    return sum(u[0] for u in units) / whole if whole else 0.0


@dataclass(frozen=True, slots=True)
class TargetIntervals:
    """One target's figures with their intervals, for the chart and the JSON output."""

    name: str
    decode_tok_s: stats.Interval | None
    ttst_ms_median: stats.Interval | None
    output_from_drafts: stats.Interval | None
    vs_baseline: stats.Interval | None  # decode tok/s / the baseline profile's, paired by request and round


def target_intervals(records: Sequence[Record], baseline: str | None, seed: int = 0) -> list[TargetIntervals]:
    names = list(dict.fromkeys(str(r.get("profile")) for r in records if _finished(r)))
    base = _by_key(records, baseline) if baseline else {}
    out = []
    for name in names:
        mine = _by_key(records, name)
        units = list(mine.values())
        ttsts = [float(r["ttst_ms"]) for r in units if r.get("ttst_ms") is not None]
        pairs = [(_speed_unit(mine[k]), _speed_unit(base[k])) for k in sorted(set(mine) & set(base))]
        out.append(
            TargetIntervals(
                name,
                stats.bootstrap([_speed_unit(r) for r in units], stats.throughput, seed=seed),
                stats.bootstrap(ttsts, stats.median, seed=seed),
                stats.bootstrap([_drafts_unit(r) for r in units], _share, seed=seed),
                stats.paired_ratio(pairs, stats.throughput, seed=seed) if pairs else None,
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class Comparison:
    """Adaptive against one other target: decode throughput and median TTST ratios, each with its interval."""

    against: str
    speed: stats.Interval | None
    ttst: stats.Interval | None


def compare(records: Sequence[Record], against: str, seed: int = 0) -> Comparison:
    """adaptive / `against`, paired by (request, round)."""
    mine, theirs = _by_key(records, ADAPTIVE), _by_key(records, against)
    keys = sorted(set(mine) & set(theirs))

    speed_pairs = [(_speed_unit(mine[k]), _speed_unit(theirs[k])) for k in keys]
    speed = stats.paired_ratio(speed_pairs, stats.throughput, seed=seed)
    ttst_pairs = [
        (float(mine[k]["ttst_ms"]), float(theirs[k]["ttst_ms"]))
        for k in keys
        if mine[k].get("ttst_ms") is not None and theirs[k].get("ttst_ms") is not None
    ]
    return Comparison(against, speed, stats.paired_ratio(ttst_pairs, stats.median, seed=seed))


def best_static(records: Sequence[Record], statics: Sequence[str]) -> str | None:
    """The static setting with the highest decode throughput over the requests every static finished: the one a
    user would pick for this workload with hindsight, and the bar the adaptive route must clear."""
    passes = {p: _by_key(records, p) for p in statics}
    keys = set.intersection(*(set(v) for v in passes.values())) if passes else set()
    if not keys:
        return None
    return max(statics, key=lambda p: stats.throughput([_speed_unit(passes[p][k]) for k in sorted(keys)]))


def describe_best(records: Sequence[Record], statics: Sequence[str], seed: int = 0) -> str | None:
    """'best static setting: ngram; adaptive vs it: decode tok/s 0.98× [...] indistinguishable; ...', or None."""
    best = best_static(records, statics)
    if best is None or not any(r.get("profile") == ADAPTIVE for r in records):
        return None
    verdict = describe(compare(records, best, seed)).split(": ", 1)[1]
    return f"best static setting for this workload: {best}; adaptive vs it: {verdict}"


def comparisons(records: Sequence[Record], statics: Sequence[str], seed: int = 0) -> list[Comparison]:
    if not any(r.get("profile") == ADAPTIVE for r in records):
        return []
    present = {str(r.get("profile")) for r in records}
    return [compare(records, t, seed) for t in [*statics, *REFERENCES] if t in present]


def describe(c: Comparison) -> str:
    """One verdict line: 'adaptive vs X: decode tok/s 1.02× [0.97, 1.08] indistinguishable; TTST p50 …'."""
    parts = []
    if c.speed is not None:
        parts.append(f"decode tok/s {c.speed.text()} {stats.verdict(c.speed, 'faster', 'slower')}")
    if c.ttst is not None:
        parts.append(f"TTST p50 {c.ttst.text()} {stats.verdict(c.ttst, 'later second token', 'sooner second token')}")
    note = {BEST_STATIC: " (not an upper bound)", BEST_SEEN: " (an upper bound)"}.get(c.against, "")
    return f"adaptive vs {c.against}{note}: " + ("; ".join(parts) or "no paired requests")


def as_json(c: Comparison) -> dict[str, Any]:
    def one(i: stats.Interval | None, higher: str, lower: str) -> dict[str, Any] | None:
        if i is None:
            return None
        return {**asdict(i), "verdict": stats.verdict(i, higher, lower)}

    return {
        "against": c.against,
        "decode_tok_s": one(c.speed, "faster", "slower"),
        "ttst_median": one(c.ttst, "later second token", "sooner second token"),
    }
