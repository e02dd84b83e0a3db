"""A simulator of routing at speeds measured elsewhere: the same `decide` and speed model the proxy runs, fed with
decode speeds from a table instead of a llama-server, to show the comparison at GPU speeds this machine lacks.

Each request belongs to a class: `iterative` (a turn of an edit session whose output copies its context) or
`oneshot` (an unrelated prompt). A scenario gives each profile kind's decode tok/s per class and its time from
first to second token; everything else (prefill speed, slot save/restore cost, copyability per class) is an
assumption stated in the Scenario and printed with the results. The static targets keep every session on one
profile; `adaptive` runs `decide` per request, learning speeds from what it is served; `oracle` takes, per request,
the better of the two static runs.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from adaptive_spec.bench.workload import Workload
from adaptive_spec.policy.model import Policy
from adaptive_spec.routing.decide import decide
from adaptive_spec.routing.estimate import ProfileState, RequestState, SessionState
from adaptive_spec.routing.placements import Placements, observe
from adaptive_spec.routing.prompt.first_turn import looks_copy_heavy
from adaptive_spec.routing.speeds import SpeedModel
from adaptive_spec.telemetry.records import Timings

PLAIN, NGRAM = "plain", "ngram"


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    description: str
    # decode tok/s by (profile kind, request class)
    decode_tps: dict[tuple[str, str], float]
    # time to the second token of a one-shot prompt (`oneshot_prompt_tokens` long), ms, by profile kind; other
    # requests add the prefill of their uncached tokens beyond that and any slot handoff
    ttst_ms: dict[str, float]
    prefill_tps: float
    save_s_per_token: float
    restore_s: float
    oneshot_prompt_tokens: int = 250
    copy_share: dict[str, float] = field(default_factory=lambda: {"iterative": 0.85, "oneshot": 0.03})
    profile_names: dict[str, str] = field(default_factory=lambda: {PLAIN: PLAIN, NGRAM: NGRAM})


# The public benchmark (Qwen 27B, one GPU): DFlash 198.7 tok/s on an 18-turn coding session and 176.1 on 100 one-shot
# prompts (30.5 ms to the second token); DFlash + ngram-mod 304.3 and 170.3 (69.1 ms). Prefill speed and slot
# save/restore costs are not published: assumed 4,000 tok/s, and this machine's measured handoff (0.27 s per 7,439
# tokens saved, 16 ms restore) as an upper bound.
GPU = Scenario(
    name="gpu",
    description="public GPU benchmark: DFlash vs DFlash + ngram-mod (Qwen 27B)",
    decode_tps={
        (PLAIN, "iterative"): 198.7,
        (PLAIN, "oneshot"): 176.1,
        (NGRAM, "iterative"): 304.3,
        (NGRAM, "oneshot"): 170.3,
    },
    ttst_ms={PLAIN: 30.5, NGRAM: 69.1},
    prefill_tps=4000.0,
    save_s_per_token=0.27 / 7439,
    restore_s=0.016,
    profile_names={PLAIN: "dflash", NGRAM: "dflash+ngram"},
)
# This CPU with the 0.5B model (no speculation vs ngram-mod 24/48/64, -t 2), measured before this simulator existed;
# time to the second token from the bench's one-shot workload (573 vs 576 ms, -t 1).
CPU = Scenario(
    name="cpu",
    description="this CPU, Qwen2.5-Coder-0.5B: no speculation vs ngram-mod",
    decode_tps={
        (PLAIN, "iterative"): 23.7,
        (PLAIN, "oneshot"): 47.2,
        (NGRAM, "iterative"): 40.9,
        (NGRAM, "oneshot"): 45.6,
    },
    ttst_ms={PLAIN: 570.0, NGRAM: 575.0},
    prefill_tps=400.0,
    save_s_per_token=0.27 / 7439,
    restore_s=0.016,
    profile_names={PLAIN: "oneshot", NGRAM: "iterative"},
)
SCENARIOS = {s.name: s for s in (GPU, CPU)}


@dataclass(frozen=True, slots=True)
class SimRequest:
    index: int
    session: str
    klass: str  # iterative | oneshot
    new_prompt_tokens: int  # tokens this turn adds to the session's context
    output_tokens: int
    copy_hint: bool


@dataclass(frozen=True, slots=True)
class Served:
    index: int
    klass: str
    profile: str
    output_tokens: int
    decode_s: float
    ttst_ms: float
    moved: bool


@dataclass(frozen=True, slots=True)
class SimRow:
    target: str
    output_tokens: int
    decode_tok_s: float
    ttst_ms_median: float
    ttst_ms_median_oneshot: float | None
    moves: int
    share_on_ngram: float  # of output tokens


def requests_from_workload(workload: Workload, chars_per_token: float = 3.5) -> list[SimRequest]:
    """A workload's requests as simulator requests: sessions with several turns are edit sessions (iterative),
    the others one-shot; outputs are the requests' max_tokens, prompts their text."""
    turns: dict[str, int] = {}
    for r in workload.requests:
        turns[r.session] = turns.get(r.session, 0) + 1
    out, seen = [], set()
    for r in workload.requests:
        text = r.user or "".join(str(m.get("content", "")) for m in r.messages or ())
        first = r.session not in seen
        seen.add(r.session)
        new = len(text) / chars_per_token + (len(workload.systems.get(r.session, "")) / chars_per_token if first else 0)
        klass = "iterative" if turns[r.session] > 1 else "oneshot"
        out.append(
            SimRequest(r.index, r.session, klass, int(new), r.max_tokens, looks_copy_heavy(text, Policy().first_turn))
        )
    return out


def public_mix(
    turns: int = 18, oneshots: int = 100, file_tokens: int = 1500, oneshot_tokens: int = 270
) -> list[SimRequest]:
    """The public benchmark's two workloads as one day of work: an 18-turn edit session (each turn returns the whole
    file) with the 100 one-shot prompts interleaved, outputs sized for a 50/50 token mix."""
    out: list[SimRequest] = []
    per_turn = max(1, oneshots // turns)
    q = 0
    for t in range(turns):
        out.append(SimRequest(len(out), "edit", "iterative", file_tokens + 200 if t == 0 else 120, file_tokens, t == 0))
        for _ in range(per_turn if t < turns - 1 else oneshots - q):
            out.append(SimRequest(len(out), f"q{q}", "oneshot", 250, oneshot_tokens, False))
            q += 1
    return out


def _ttst_ms(scenario: Scenario, kind: str, prefill_tokens: int, handoff_s: float) -> float:
    extra = max(0, prefill_tokens - scenario.oneshot_prompt_tokens) / scenario.prefill_tps
    return scenario.ttst_ms[kind] + (extra + handoff_s) * 1000


def _run_static(requests: Sequence[SimRequest], scenario: Scenario, kind: str) -> list[Served]:
    context: dict[str, int] = {}
    served = []
    for r in requests:
        context[r.session] = context.get(r.session, 0) + r.new_prompt_tokens
        tps = scenario.decode_tps[(kind, r.klass)]
        served.append(
            Served(
                r.index,
                r.klass,
                kind,
                r.output_tokens,
                r.output_tokens / tps,
                _ttst_ms(scenario, kind, r.new_prompt_tokens, 0.0),
                False,
            )
        )
        context[r.session] += r.output_tokens
    return served


def _run_adaptive(
    requests: Sequence[SimRequest], scenario: Scenario, policy: Policy, noise: float = 0.0
) -> list[Served]:
    """`noise`: each turn's copyability estimate is off by up to ± this much (uniform, seeded), as the real
    counterfactual estimate is."""
    rng = random.Random(7)
    names = scenario.profile_names
    kind_of = {names[PLAIN]: PLAIN, names[NGRAM]: NGRAM}
    speeds = SpeedModel(policy.estimator, policy.handoff, {names[PLAIN]: ("none",), names[NGRAM]: ("ngram-mod",)})
    placements = Placements()
    profiles = [ProfileState(names[PLAIN], handoff=True), ProfileState(names[NGRAM], handoff=True)]
    context: dict[str, int] = {}
    history: dict[str, tuple[int, float]] = {}  # session -> (turns, copy EWMA)
    served = []
    for r in requests:
        context[r.session] = context.get(r.session, 0) + r.new_prompt_tokens
        prompt = context[r.session]
        turns, copy_share = history.get(r.session, (0, None))
        request = RequestState(
            body_bytes=int(prompt * policy.estimator.chars_per_token), max_tokens=r.output_tokens, copy_hint=r.copy_hint
        )
        decision = decide(
            request, SessionState(r.session, turns, copy_share, placements.get(r.session)), profiles, speeds, policy
        )
        kind = kind_of[decision.profile]
        placement = placements.get(r.session)
        cached = placement.cached_tokens if placement is not None and placement.profile == decision.profile else 0
        handoff_s = 0.0
        if decision.handoff:
            handoff_s = decision.handoff_tokens * scenario.save_s_per_token + scenario.restore_s
            speeds.observe_handoff(decision.handoff_tokens, handoff_s - scenario.restore_s, scenario.restore_s)
            cached = decision.handoff_tokens
        prefill = max(0, prompt - cached)
        tps = scenario.decode_tps[(kind, r.klass)]
        ttst = _ttst_ms(scenario, kind, prefill, handoff_s)
        moved = decision.moved_from is not None
        served.append(Served(r.index, r.klass, decision.profile, r.output_tokens, r.output_tokens / tps, ttst, moved))
        timings = Timings(
            prompt_n=prefill,
            cache_n=prompt - prefill,
            predicted_n=r.output_tokens,
            prompt_ms=prefill / scenario.prefill_tps * 1000,
            predicted_ms=r.output_tokens / tps * 1000,
            predicted_per_second=tps,
        )
        observe(speeds, placements, decision.profile, 0, r.session, decision.copy_share, timings, request.body_bytes)
        share = min(1.0, max(0.0, scenario.copy_share[r.klass] + rng.uniform(-noise, noise)))
        history[r.session] = (turns + 1, share if copy_share is None else 0.5 * share + 0.5 * copy_share)
        context[r.session] += r.output_tokens
    return served


def _row(target: str, served: Sequence[Served], ngram_name: str) -> SimRow:
    out = sum(s.output_tokens for s in served)
    decode = sum(s.decode_s for s in served)
    oneshot = [s.ttst_ms for s in served if s.klass == "oneshot"]
    on_ngram = sum(s.output_tokens for s in served if s.profile in (NGRAM, ngram_name))
    return SimRow(
        target=target,
        output_tokens=out,
        decode_tok_s=out / decode if decode else 0.0,
        ttst_ms_median=statistics.median(s.ttst_ms for s in served),
        ttst_ms_median_oneshot=statistics.median(oneshot) if oneshot else None,
        moves=sum(s.moved for s in served),
        share_on_ngram=on_ngram / out if out else 0.0,
    )


def simulate_targets(
    requests: Sequence[SimRequest], scenario: Scenario, policy: Policy | None = None, noise: float = 0.3
) -> list[SimRow]:
    """Always-plain, always-n-gram, adaptive (exact per-class copyability), adaptive with estimates off by up to
    ± `noise`, and the per-request oracle (the last row)."""
    policy = policy or Policy()
    names = scenario.profile_names
    plain = _run_static(requests, scenario, PLAIN)
    ngram = _run_static(requests, scenario, NGRAM)
    oracle = [min(a, b, key=lambda s: s.decode_s) for a, b in zip(plain, ngram, strict=True)]
    adaptive = _run_adaptive(requests, scenario, policy)
    return [
        _row(f"always {names[PLAIN]}", plain, names[NGRAM]),
        _row(f"always {names[NGRAM]}", ngram, names[NGRAM]),
        _row("adaptive", adaptive, names[NGRAM]),
        _row(f"adaptive, estimates ±{noise:.0%}", _run_adaptive(requests, scenario, policy, noise), names[NGRAM]),
        _row("oracle (per request)", oracle, names[NGRAM]),
    ]


def to_markdown(rows: Sequence[SimRow], scenario: Scenario, workload: str) -> str:
    oracle = rows[-1]
    lines = [
        f"simulated: {scenario.description}; workload {workload}",
        "| target | output tokens | decode tok/s | × always " + scenario.profile_names[PLAIN] + " | vs oracle "
        "| TTST p50 (ms) | TTST p50 one-shot (ms) | moves | output on n-gram profile |",
        "|" + "---|" * 9,
    ]
    base = rows[0].decode_tok_s
    for r in rows:
        one = f"{r.ttst_ms_median_oneshot:.1f}" if r.ttst_ms_median_oneshot is not None else "—"
        lines.append(
            f"| {r.target} | {r.output_tokens} | {r.decode_tok_s:.1f} | {r.decode_tok_s / base:.3f} | "
            f"{r.decode_tok_s / oracle.decode_tok_s:.3f} | {r.ttst_ms_median:.1f} | {one} | {r.moves} | "
            f"{r.share_on_ngram:.0%} |"
        )
    return "\n".join(lines)
