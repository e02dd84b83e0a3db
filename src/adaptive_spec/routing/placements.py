"""Placements: where each session's KV cache lives (profile, slot, cached tokens), which slot of a several-slot profile
a session holds, and `observe()`, the one step that learns from a request served in full.

The proxy's router shell and the simulator both call `observe()`, so the simulator learns exactly as the proxy does."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from adaptive_spec.common.lru import LRU
from adaptive_spec.routing.speeds import MIN_DRAFTED, SpeedModel, drafted_per_step, drafter_acceptance
from adaptive_spec.telemetry.records import Timings


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a session's KV cache lives: the profile (and slot) that served its last turn."""

    profile: str
    slot: int | None
    cached_tokens: int  # prompt + output of the last turn, cached in that slot
    turns_here: int  # consecutive turns served on this profile
    output_tokens: float  # average output tokens per turn (EWMA)
    # Whether the slot still holds this session. Another session served there since displaced it: the profile may
    # still have the prompt in its RAM cache, but a slot save would capture the other session's KV.
    in_slot: bool = True
    replica: int = 0  # which replica of the profile (a pool of llama-servers) holds it
    # The share of a model drafter's tokens the target accepted on this session's answers (EWMA over the turns that
    # drafted, from llama-server's counts; None: none measured yet), and over how many turns.
    drafter_acceptance: float | None = None
    drafter_turns: int = 0
    # The drafter's mean draft length per verification step on its answers (EWMA; llama-server's counts: drafted over
    # steps, a step being an output token not accepted from a draft), at which `drafter_acceptance` was measured.
    drafted_per_step: float | None = None
    # Whether a slot action (a head's restore, a handoff's, a remote prefill's, an erase) overwrote the slot while it
    # held this session: llama-server saves a slot's prompt to its RAM cache only when a request takes the slot over,
    # so nothing of the session's KV is left on the server.
    overwritten: bool = False


class Placements:
    """Where each session's KV cache lives (bounded: least recently used sessions are forgotten)."""

    def __init__(
        self,
        max_sessions: int = 4096,
        alpha: float = 0.5,
        home: Callable[[str, int], tuple[str, int]] = lambda profile, replica: (profile, replica),
    ) -> None:
        """`home`: the server a (profile, replica) runs on, as a key; profiles on one server share its slots."""
        self._by_session: LRU[str, Placement] = LRU(max_sessions)
        self.max_sessions, self.alpha, self._home = max_sessions, alpha, home
        # The sessions marked in each slot of each server, so that a request displaces them without a scan.
        self._in_slot: dict[tuple[tuple[str, int], int | None], set[str]] = {}

    def _slot(self, profile: str, replica: int, slot: int | None) -> tuple[tuple[str, int], int | None]:
        return self._home(profile, replica), slot

    def get(self, session_id: str | None) -> Placement | None:
        return self._by_session.get(session_id) if session_id is not None else None

    def served(
        self,
        session_id: str,
        profile: str,
        slot: int | None,
        cached_tokens: int,
        output_tokens: int,
        replica: int = 0,
        acceptance: float | None = None,
        drafted_per_step: float | None = None,
    ) -> None:
        """`acceptance`: this answer's drafter acceptance (None: the drafter drafted nothing for it), its drafts
        `drafted_per_step` tokens long on average."""
        old = self._by_session.get(session_id)
        turns = old.turns_here + 1 if old is not None and old.profile == profile else 1
        out = float(output_tokens) if old is None else self.alpha * output_tokens + (1 - self.alpha) * old.output_tokens
        accepted, drafted_turns = (old.drafter_acceptance, old.drafter_turns) if old is not None else (None, 0)
        length = old.drafted_per_step if old is not None else None
        if acceptance is not None:
            accepted = acceptance if accepted is None else self.alpha * acceptance + (1 - self.alpha) * accepted
            drafted_turns += 1
        if acceptance is not None and drafted_per_step is not None:
            fresh = drafted_per_step
            length = fresh if length is None else self.alpha * fresh + (1 - self.alpha) * length
        if old is not None and old.in_slot:
            self._in_slot.get(self._slot(old.profile, old.replica, old.slot), set()).discard(session_id)
        placement = Placement(
            profile,
            slot,
            cached_tokens,
            turns,
            out,
            replica=replica,
            drafter_acceptance=accepted,
            drafter_turns=drafted_turns,
            drafted_per_step=length,
        )
        dropped = self._by_session.put(session_id, placement)
        self._in_slot.setdefault(self._slot(profile, replica, slot), set()).add(session_id)
        for sid, gone in dropped:
            self._in_slot.get(self._slot(gone.profile, gone.replica, gone.slot), set()).discard(sid)

    def adopt(self, session_id: str, placement: Placement) -> None:
        """Where another proxy placed the session (shared state, read before routing): it stands over what this one
        knew."""
        old = self._by_session.get(session_id)
        if old is not None:
            self._in_slot.get(self._slot(old.profile, old.replica, old.slot), set()).discard(session_id)
        dropped = self._by_session.put(session_id, placement)
        if placement.in_slot:
            self._in_slot.setdefault(self._slot(placement.profile, placement.replica, placement.slot), set()).add(
                session_id
            )
        for sid, gone in dropped:
            self._in_slot.get(self._slot(gone.profile, gone.replica, gone.slot), set()).discard(sid)

    def displace(
        self, profile: str, slot: int | None, keep: str | None, replica: int = 0, overwritten: bool = False
    ) -> None:
        """`keep` now occupies this slot (served there, or restored into it; None: nobody, it was erased): the other
        sessions it held are out of the slot. Taken by a request, their prompts live on in the server's RAM cache
        (their cached figures stay); `overwritten` by a slot action, nothing of them does."""
        where = self._slot(profile, replica, slot)
        held = self._in_slot.get(where)
        if not held:
            return
        for sid in [sid for sid in held if sid != keep]:
            held.discard(sid)
            p = self._by_session.get(sid)
            if p is not None and p.in_slot and self._slot(p.profile, p.replica, p.slot) == where:
                self._by_session.replace(sid, replace(p, in_slot=False, overwritten=overwritten))

    def __len__(self) -> int:
        return len(self._by_session)

    def count_on(self, profile: str, replica: int) -> int:
        """Sessions whose KV cache lives on this replica's server (a tie-break for new sessions: spread them)."""
        home = self._home(profile, replica)
        return sum(1 for _, p in self._by_session.items() if self._home(p.profile, p.replica) == home)

    def items(self) -> list[tuple[str, Placement]]:
        return self._by_session.items()


@dataclass
class SlotBook:
    """Which slot of a several-slot profile each session uses, and which slots are busy."""

    slots: int
    by_session: LRU[str, int] = field(default_factory=lambda: LRU(10_000))  # session -> its slot
    busy: dict[int, int] = field(default_factory=dict)
    last_used: dict[int, float] = field(default_factory=dict)
    # Requests other proxies booked in each slot (shared state, read before routing; empty with one proxy).
    elsewhere: dict[int, int] = field(default_factory=dict)

    def taken(self, slot: int) -> bool:
        """Whether a request of this proxy or of another one occupies the slot."""
        return bool(self.busy.get(slot) or self.elsewhere.get(slot))

    def pick(self, session_id: str | None, side: bool = False) -> int:
        """The session's own slot when free, else the least recently used free one. A side request (a title, a
        commit message) goes to another slot than its session's, which keeps the session's KV."""
        mine = self.by_session.get(session_id) if session_id is not None else None
        if side:
            others = [s for s in range(self.slots) if s != mine]
            free = [s for s in others if not self.taken(s)] or others or list(range(self.slots))
            return min(free, key=lambda s: self.last_used.get(s, 0.0))
        if mine is not None and not self.taken(mine):
            return mine
        free = [s for s in range(self.slots) if not self.taken(s)] or list(range(self.slots))
        slot = min(free, key=lambda s: self.last_used.get(s, 0.0))
        if session_id is not None:
            self.by_session.put(session_id, slot)
        return slot


def observe(
    speeds: SpeedModel,
    placements: Placements,
    profile: str,
    slot: int | None,
    session_id: str | None,
    copy_share: float,
    timings: Timings,
    body_bytes: int,
    replica: int = 0,
) -> None:
    """Learn from a request served in full on `profile` (its `replica`): its speeds, and that the session's KV now
    lives in `slot` there (whichever session held that slot before is out of it). Speeds are learned per profile:
    the replicas of a pool run the same model and setup."""
    speeds.observe(profile, copy_share, timings, body_bytes)
    if session_id is None and slot is not None:
        # A request of no session's line (a side request in a slot of its own) still overwrote that slot.
        placements.displace(profile, slot, keep=None, replica=replica)
    if session_id is not None:
        placements.displace(profile, slot, keep=session_id, replica=replica)
        cached = timings.cache_n + timings.prompt_n + timings.predicted_n
        acceptance, length = None, None
        if speeds.has_drafter(profile):
            drafter_only = not speeds.is_ngram(profile)
            acceptance = drafter_acceptance(timings, drafter_only, min_drafted=MIN_DRAFTED)
            length = drafted_per_step(timings)
        placements.served(session_id, profile, slot, cached, timings.predicted_n, replica, acceptance, length)
