"""Which replica of a profile serves a request: the choice after `decide()` has picked the profile.

A profile may run on several llama-servers (a pool: same model, same speculation setup, maybe other hosts). The
profile-level decision stays `decide()`'s; `choose_replica()` is pure and picks among the profile's replicas:

- a session whose KV cache lives on a healthy replica of this profile stays there;
- a session whose replica is down is re-placed on the least loaded healthy one (it re-prefills: the KV is gone);
- a session whose replica is overloaded (every slot busy and requests queued) moves to an idle replica when the
  move costs less than the wait: with its KV (slot save + transfer + restore) when the two can hand over, else by
  re-prefilling;
- a new session (or one arriving from another profile) goes to the least loaded replica: most free slots, then
  fewest requests in flight, then fewest sessions placed there, then most free slots never used (where its KV
  evicts no session's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

# The one replica there is; the session's own; the least loaded (a new session, or its replica down); a session
# re-placed (its replica down or overloaded: it re-prefills, or takes its KV along); moved off an overloaded one.
ReplicaKind = Literal["only", "stay", "least-loaded", "replaced", "rebalanced"]


@dataclass(frozen=True, slots=True)
class ReplicaState:
    index: int
    base_url: str = ""
    down_reason: str | None = None
    slots: int = 1
    busy_slots: int = 0  # slots with a request running (the router's own count)
    in_flight: int = 0  # requests being served, running or queued
    sessions: int = 0  # sessions whose KV cache lives here
    unused_slots: int = 0  # free slots no session has used, as far as this proxy knows (with several proxies, any)

    @property
    def free_slots(self) -> int:
        return max(0, self.slots - self.busy_slots)

    @property
    def queued(self) -> int:
        return max(0, self.in_flight - self.slots)

    @property
    def overloaded(self) -> bool:
        return self.free_slots == 0 and self.queued > 0


@dataclass(frozen=True, slots=True)
class MoveCosts:
    """What moving the session to another replica would cost and what staying costs, in seconds (the cost model's
    figures, priced by the router): `wait_s` is the expected wait per request queued ahead of it."""

    cached_tokens: int = 0
    handoff_s: float | None = None  # slot save + transfer + restore; None: the replicas cannot hand over
    reprefill_s: float = 0.0  # prefilling what the session's KV holds, on another replica
    wait_s: float = 0.0


@dataclass(frozen=True, slots=True)
class ReplicaChoice:
    replica: int
    kind: ReplicaKind
    reason: str  # empty for a profile with one replica
    moved_from: int | None = None  # the session's KV lived on this other replica of the same profile
    handoff: bool = False  # save its slot there and restore it here (else it re-prefills, or had nothing)


def load_key(r: ReplicaState) -> tuple[int, int, int, int, int]:
    """Least loaded first: most free slots, fewest in flight, fewest sessions placed, most free slots never used,
    then the lower index."""
    return (-r.free_slots, r.in_flight, r.sessions, -r.unused_slots, r.index)


def least_loaded(replicas: Sequence[ReplicaState]) -> ReplicaState | None:
    healthy = [r for r in replicas if r.down_reason is None]
    return min(healthy, key=load_key) if healthy else None


def choose_replica(
    profile: str, replicas: Sequence[ReplicaState], held_on: int | None, costs: MoveCosts | None = None
) -> ReplicaChoice:
    """`held_on`: the replica of this profile where the session's KV cache lives (None: not on this profile)."""
    if len(replicas) <= 1:
        return ReplicaChoice(replicas[0].index if replicas else 0, "only", "")
    by_index = {r.index: r for r in replicas}
    best = least_loaded(replicas)
    if best is None:  # all down: the profile is down, decide() has said so; keep the KV's replica for the record
        first = held_on if held_on in by_index else replicas[0].index
        return ReplicaChoice(first, "replaced", f"{profile}: every replica is down")
    here = by_index.get(held_on) if held_on is not None else None
    if here is None:
        return ReplicaChoice(best.index, "least-loaded", f"{profile}#{best.index}: least loaded ({_load(best)})")
    if here.down_reason is not None:
        return ReplicaChoice(
            best.index,
            "replaced",
            f"{profile}#{best.index}: replica #{here.index} is down ({here.down_reason}); re-prefills",
            moved_from=here.index,
        )
    idle = best if best.index != here.index and best.free_slots > 0 and best.queued == 0 else None
    if not here.overloaded or idle is None or costs is None:
        return ReplicaChoice(here.index, "stay", f"{profile}#{here.index}: stays on its KV cache")
    wait_s = here.queued * costs.wait_s
    move_s = costs.handoff_s if costs.handoff_s is not None else costs.reprefill_s
    how = "hands its KV over" if costs.handoff_s is not None else "re-prefills"
    if move_s >= wait_s:
        return ReplicaChoice(
            here.index,
            "stay",
            f"{profile}#{here.index}: stays though overloaded ({here.queued} queued ≈ {wait_s:.1f} s); moving to "
            f"#{idle.index} {how} ≈ {move_s:.1f} s",
        )
    return ReplicaChoice(
        idle.index,
        "rebalanced",
        f"{profile}#{idle.index}: #{here.index} overloaded ({here.queued} queued ≈ {wait_s:.1f} s); {how} "
        f"({costs.cached_tokens:,} tok ≈ {move_s:.2f} s)",
        moved_from=here.index,
        handoff=costs.handoff_s is not None,
    )


def _load(r: ReplicaState) -> str:
    return (
        f"{r.free_slots}/{r.slots} slots free, {r.in_flight} in flight, {r.sessions} sessions, {r.unused_slots} unused"
    )
