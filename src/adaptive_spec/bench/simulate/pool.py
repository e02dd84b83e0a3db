"""`bench --simulate pool`: a pool of replicas of one profile under a day of mixed agent traffic, replica choice by the
same `choose_replica()` the proxy runs, against two simpler ways to spread sessions (round robin per request, and a
sticky hash of the session with no moves).

A discrete-event simulation: every figure comes from an assumption printed with the table.

Sessions are drawn from a workload's sessions (their turns' new prompt tokens and outputs, via the simulator's
`requests_from_workload`); each agent session adds a system prompt and tools on its first turn. Each replica has a
few slots (requests beyond them queue, first come first served) and keeps the KV of its most recent sessions (its
slots and its RAM prompt cache): a session served where its KV lives prefills only its new tokens; anywhere else it
re-prefills its whole context, unless its KV is handed over (slot save + transfer + restore).
"""

from __future__ import annotations

import heapq
import random
import statistics
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from adaptive_spec.bench.simulate.routing import SimRequest
from adaptive_spec.routing.replicas import MoveCosts, ReplicaState, choose_replica


@dataclass(frozen=True, slots=True)
class PoolAssumptions:
    replicas: int = 4
    slots: int = 4  # llama-server --parallel per replica
    kv_sessions: int = 16  # sessions whose KV a replica keeps (slots + RAM prompt cache), least recent out
    day_s: float = 8 * 3600.0
    sessions: int = 2_400  # agent sessions started over the day (a team's agents)
    peak_share: float = 0.5  # of them start in the morning peak (hour 1 to 2); the rest uniformly over the day
    requests_per_session: tuple[int, int] = (10, 60)  # uniform, edit sessions: an agent's tool loop
    system_tokens: int = 7_200  # an agent's system prompt and tools (opencode's first turn measured ~7.2k here)
    think_s: tuple[float, float] = (2.0, 30.0)  # between an answer and the next request: tools run, a person reads
    prefill_tps: float = 4_000.0  # the GPU scenario's assumption (gpu in `bench --simulate`)
    decode_tps: float = 190.0  # per slot, whatever the other slots do (the public benchmark's DFlash, one user)
    save_s_per_token: float = 0.27 / 7439  # slot save, measured here (0.5B); a 27B's bigger KV is not scaled in
    restore_s: float = 0.016
    transfer_s_per_token: float = 262_144 / (10e9 / 8)  # f16 KV of a 27B (256 KiB/token) over 10 Gbit/s
    down: tuple[int, float, float] | None = None  # (replica, from s, to s): it refuses connections meanwhile
    seed: int = 11

    def lines(self) -> list[str]:
        t0, t1 = self.think_s
        n0, n1 = self.requests_per_session
        return [
            f"- {self.replicas} replicas of one profile, {self.slots} slots each, each keeping the KV of its "
            f"{self.kv_sessions} most recent sessions (slots + RAM prompt cache)",
            f"- {self.sessions:,} sessions over {self.day_s / 3600:g} h, {self.peak_share:.0%} of them starting in a "
            f"morning peak (hour 1 to 2), the rest uniformly; an edit session makes {n0} to {n1} requests (its "
            "workload session's later turns repeated), a one-shot prompt one; the first adds "
            f"{self.system_tokens:,} tokens of system prompt and tools; "
            f"{t0:g} to {t1:g} s between an answer and the next request",
            f"- prefill {self.prefill_tps:,.0f} tok/s, decode {self.decode_tps:g} tok/s per slot whatever the other "
            "slots do (optimistic: batching slows each slot a little)",
            f"- KV handoff: save {self.save_s_per_token * 1e6:.0f} µs/token + transfer "
            f"{self.transfer_s_per_token * 1e6:.0f} µs/token (256 KiB/token at 10 Gbit/s) + restore "
            f"{self.restore_s * 1000:g} ms; the live proxy can save only an idle slot that still holds the session, "
            "so the handovers here are an upper bound",
            "- a replica that goes down loses the requests it was serving: they start again elsewhere, re-prefilling "
            "(the live proxy fails over only requests refused before they reach a server)",
        ]


@dataclass(frozen=True, slots=True)
class PoolRow:
    strategy: str
    requests: int
    sessions_per_replica: tuple[int, ...]
    moves: int  # turns served on another replica than the session's previous one
    handed_over_tokens: int
    re_prefilled_moved: int  # context prefilled again because the session was served away from its KV
    re_prefilled_evicted: int  # ... because its own replica had dropped its KV (too many sessions since)
    wait_p50_s: float
    wait_p95_s: float
    ttft_p50_s: float
    restarted: int  # requests cut by a replica going down


@dataclass
class _Replica:
    free_at: list[float]  # each slot's next free time
    kv: OrderedDict[str, int] = field(default_factory=OrderedDict)  # session -> tokens it holds, LRU
    ends: list[float] = field(default_factory=list)  # end times of requests placed here (load at a time)
    sessions: set[str] = field(default_factory=set)


def _sessions(templates: Sequence[Sequence[SimRequest]], a: PoolAssumptions, rng: random.Random) -> list[list[int]]:
    """Each session as its turns' (new prompt tokens, output tokens), flattened in pairs."""
    out = []
    for _ in range(a.sessions):
        template = rng.choice(templates)
        # An edit session's later turns repeat (one-shot prompts stay one request).
        n = rng.randint(*a.requests_per_session) if len(template) > 1 else 1
        turns = [template[0]] + [template[1 + (i - 1) % (len(template) - 1)] for i in range(1, n)]
        pairs = [t.new_prompt_tokens for t in turns]
        pairs[0] += a.system_tokens
        out.append([x for t, p in zip(turns, pairs, strict=True) for x in (p, t.output_tokens)])
    return out


def _start(a: PoolAssumptions, rng: random.Random) -> float:
    return rng.uniform(3600.0, 7200.0) if rng.random() < a.peak_share else rng.uniform(0.0, a.day_s)


def simulate_pool(templates: Sequence[Sequence[SimRequest]], strategy: str, a: PoolAssumptions) -> PoolRow:
    """`strategy`: adaptive-spec (choose_replica) | round robin | sticky hash."""
    rng = random.Random(a.seed)
    shapes = _sessions(templates, a, rng)
    events: list[tuple[float, int, int]] = [(_start(a, rng), s, 0) for s in range(len(shapes))]
    heapq.heapify(events)
    reps = [_Replica([0.0] * a.slots) for _ in range(a.replicas)]
    where: dict[int, int] = {}
    context: dict[int, int] = {}
    waits, ttfts = [], []
    moves = handed = moved_prefill = evicted_prefill = restarted = requests = rr = 0
    while events:
        t, s, turn = heapq.heappop(events)
        sid = f"s{s}"
        new, out = shapes[s][2 * turn], shapes[s][2 * turn + 1]
        up = [i for i in range(a.replicas) if not _is_down(a, i, t)]
        prev = where.get(s)
        if strategy == "round robin":
            r = up[rr % len(up)]
            rr += 1
            handoff = False
        elif strategy == "sticky hash":
            home = s % a.replicas
            r = home if home in up else up[s % len(up)]
            handoff = False
        else:
            placed = [0] * a.replicas
            for where_s in where.values():
                placed[where_s] += 1
            r, handoff = _choose(reps, up, prev, sid, t, new, out, context.get(s, 0), placed, a)
        ctx = context.get(s, 0) + new
        held = reps[prev].kv.get(sid, 0) if prev is not None else 0
        if prev is not None and r != prev:
            moves += 1
        if handoff and held:
            handed += held
            reps[prev].kv.pop(sid, None)  # type: ignore[index]
            extra = held * (a.save_s_per_token + a.transfer_s_per_token) + a.restore_s
            prefill = ctx - held
        else:
            mine = reps[r].kv.get(sid, 0)
            prefill = ctx - mine
            if prev is not None and r != prev:
                moved_prefill += max(0, ctx - new - mine)
            else:
                evicted_prefill += max(0, ctx - new - mine)
            extra = 0.0
        rep = reps[r]
        slot = min(range(a.slots), key=lambda i: rep.free_at[i])
        start = max(t, rep.free_at[slot])
        first = start + extra + prefill / a.prefill_tps
        end = first + out / a.decode_tps
        if a.down is not None and a.down[0] == r and start < a.down[1] <= end:
            restarted += 1  # cut when the replica went down: served again on another one, from scratch
            reps[r].kv.pop(sid, None)
            heapq.heappush(events, (a.down[1], s, turn))
            context[s] = ctx - new
            where[s] = r
            continue
        rep.free_at[slot] = end
        waits.append(start - t)
        ttfts.append(first - t)
        requests += 1
        where[s], context[s] = r, ctx + out
        rep.sessions.add(sid)
        rep.kv[sid] = ctx + out
        rep.kv.move_to_end(sid)
        rep.ends.append(end)
        while len(rep.kv) > a.kv_sessions:
            rep.kv.popitem(last=False)
        if 2 * (turn + 1) < len(shapes[s]):
            heapq.heappush(events, (end + rng.uniform(*a.think_s), s, turn + 1))
    return PoolRow(
        strategy=strategy,
        requests=requests,
        sessions_per_replica=tuple(len(x.sessions) for x in reps),
        moves=moves,
        handed_over_tokens=handed,
        re_prefilled_moved=moved_prefill,
        re_prefilled_evicted=evicted_prefill,
        wait_p50_s=statistics.median(waits),
        wait_p95_s=statistics.quantiles(waits, n=20)[-1],
        ttft_p50_s=statistics.median(ttfts),
        restarted=restarted,
    )


def _is_down(a: PoolAssumptions, replica: int, t: float) -> bool:
    return a.down is not None and a.down[0] == replica and a.down[1] <= t < a.down[2]


def _choose(
    reps: list[_Replica],
    up: list[int],
    prev: int | None,
    sid: str,
    t: float,
    new: int,
    out: int,
    context: int,
    placed: list[int],
    a: PoolAssumptions,
) -> tuple[int, bool]:
    """The proxy's own choice, from the replicas' load at time t."""
    states = []
    for i, rep in enumerate(reps):
        in_flight = sum(1 for e in rep.ends if e > t)
        busy = sum(1 for f in rep.free_at if f > t)
        states.append(
            ReplicaState(
                i,
                down_reason=None if i in up else "down",
                slots=a.slots,
                busy_slots=busy,
                in_flight=in_flight,
                sessions=placed[i],  # as the proxy's placements count them
            )
        )
        rep.ends = [e for e in rep.ends if e > t]  # the past no longer counts
    held = reps[prev].kv.get(sid, 0) if prev is not None else 0
    costs = None
    if prev is not None:
        costs = MoveCosts(
            cached_tokens=held,
            handoff_s=held * (a.save_s_per_token + a.transfer_s_per_token) + a.restore_s if held else None,
            reprefill_s=context / a.prefill_tps,
            wait_s=new / a.prefill_tps + out / a.decode_tps,
        )
    choice = choose_replica("pool", states, prev, costs)
    return choice.replica, choice.handoff


def pool_tables(templates: Sequence[Sequence[SimRequest]], workload: str, a: PoolAssumptions | None = None) -> str:
    a = a or PoolAssumptions()
    down = replace(a, down=(a.replicas - 1, 1.5 * 3600, 3.5 * 3600))
    lines = [f"simulated: a pool of {a.replicas} replicas, a day of mixed agent traffic (sessions from {workload})"]
    for title, case in (
        ("all replicas up", a),
        (f"replica #{a.replicas - 1} down from hour 1.5 to hour 3.5 (in the peak)", down),
    ):
        lines += [
            "",
            f"{title}:",
            "",
            "| strategy | requests | sessions per replica | moves | tokens handed over | re-prefilled: moved "
            "| re-prefilled: evicted | wait p50 / p95 | TTFT p50 | cut by the failure |",
            "|" + "---|" * 10,
        ]
        for strategy in ("adaptive-spec", "sticky hash", "round robin"):
            r = simulate_pool(templates, strategy, case)
            lines.append(
                f"| {r.strategy} | {r.requests:,} | {' / '.join(str(n) for n in r.sessions_per_replica)} | {r.moves:,} "
                f"| {r.handed_over_tokens:,} | {r.re_prefilled_moved:,} | {r.re_prefilled_evicted:,} "
                f"| {r.wait_p50_s:.1f} s / {r.wait_p95_s:.1f} s "
                f"| {r.ttft_p50_s:.2f} s | {r.restarted} |"
            )
    return "\n".join([*lines, "", "assumptions:", *a.lines()])
