"""What the router asks the KV layer to do, and what comes back: values only (pure).

The router decides a handoff, a head restore or a remote prefill and names one of these in its route; the request path
has it carried out (`requests/carry_out.py`: through `kv/effects.py`, a head restore through the head store), and the
results go into the request's record. Where a request completes, the router's `plan_save` decides what the head store
does with the turn (`AfterTurn`, with the `HeadSave` it asks for), and the store carries it out."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adaptive_spec.kv.costs import PrefillRate
from adaptive_spec.kv.heads.activity import TurnMark
from adaptive_spec.kv.heads.matching import Match
from adaptive_spec.kv.heads.values import Restored, SavedTurn

_HANDOFF_BASE_TIMEOUT_S = 10.0
_HANDOFF_TIMEOUT_S_PER_TOKEN = 0.0005  # a save of N tokens takes milliseconds per thousand here
_MIN_SAVED_SHARE = 0.9  # a save that wrote less of the session's tokens captured another session's KV


@dataclass(frozen=True, slots=True)
class SlotAt:
    profile: str
    replica: int
    slot: int | None  # None: the server's only slot (or one the request does not name)

    @property
    def label(self) -> str:
        """How messages name its server: the profile, and the replica when it has a pool (as `Upstream.label`)."""
        return f"{self.profile}#{self.replica}" if self.replica else self.profile


@dataclass(frozen=True, slots=True)
class SlotMove:
    """Save the session's slot where its KV lives and restore it where the request goes."""

    session_id: str
    source: SlotAt
    target: SlotAt
    cached_tokens: int  # what the source slot holds of the session

    @property
    def timeout_s(self) -> float:
        """Bounded: a slot that stays busy must not hold the request for long (on failure it re-prefills)."""
        return _HANDOFF_BASE_TIMEOUT_S + self.cached_tokens * _HANDOFF_TIMEOUT_S_PER_TOKEN

    @property
    def min_tokens(self) -> int:
        return int(_MIN_SAVED_SHARE * self.cached_tokens)


@dataclass(frozen=True, slots=True)
class HandoffResult:
    ok: bool
    tokens: int
    save_s: float
    restore_s: float
    error: str | None = None
    transfer_s: float = 0.0  # the slot file's trip between hosts (a relay mover)
    bytes: int = 0


@dataclass(frozen=True, slots=True)
class HeadRestore:
    """Restore a stored head into the slot a session's first request goes to (`kv/heads/choice.choose_head` chose it
    and priced it against the prefill it saves); the head store carries it out, or gives it up (busy slot, lock,
    damaged file): the request then prefills."""

    at: SlotAt
    server: str  # the base URL of the server the view was taken of
    match: Match
    restore_s: float  # the restore's price, and the prefill it saves: how long it may wait for the store's lock
    prefill_s: float
    held: Restored | None = None  # the slot holds that head since its server started: nothing to restore


@dataclass(frozen=True, slots=True)
class HeadSave:
    """Save the slot a served turn left into the head store: a session's first turn as an agent's head, at once in the
    background (`idle_s` 0), or a later turn as its session's state (`turn.session`) once the session has been idle
    `idle_s` seconds. The head store carries it out, and drops it when the slot served another request since the turn
    (`mark`: the turn's as it was forwarded; None: judged by the requests forwarded during the save alone)."""

    at: SlotAt
    server: str  # the base URL of the server that served the turn
    turn: SavedTurn
    mark: TurnMark | None
    idle_s: float = 0.0


@dataclass(frozen=True, slots=True)
class AfterTurn:
    """What a served request asks of the head store (`routing/move_planner.plan_save`): its tenant's share of the bound,
    the head restored for it judged against what its prompt reused (`inert`: it reused too little of it), the
    session's older state no longer waited for (a newer turn came), and the save it asks for, if any."""

    scope: str  # the tenant scope of the request's key
    share_bytes: int  # that tenant's share of the bound, as its policy says (0: an equal share)
    restored: Restored | None = None
    cache_n: int = 0  # what the request reused of it (llama-server's count)
    inert: bool = False
    session: str | None = None  # the session whose older state is not saved any more (a side request's: None)
    save: HeadSave | None = None
    mark: TurnMark | None = None  # the request's, for the judge: did another proxy's request come between (shared)


@dataclass(frozen=True, slots=True)
class PrefillAsk:
    """A prompt the router prefills on the remote server instead of here (`remote_prefill/pricing.choose` said it is
    faster): its slot file is brought back and restored into the local slot."""

    at: SlotAt
    session_id: str | None
    path: str  # the upstream path and body of the request, as the remote server is to see it
    body: dict[str, Any]
    new_tokens: int
    context_tokens: int
    local: PrefillRate  # the router's prefill cost here
    slot_busy: bool  # the slot is serving another request (a restore into it now would be overwritten)

    @property
    def local_s(self) -> float:
        """The prefill here, as estimated (`remote_prefill/pricing.choose`'s local side): the remote path's deadline."""
        return self.local.seconds(self.new_tokens, max(0, self.context_tokens - self.new_tokens))


@dataclass(frozen=True, slots=True)
class RemotePrefillResult:
    """What a remote prefill did, for the request's record."""

    ok: bool
    tokens: int  # tokens the restored slot holds
    remote_prefill_s: float
    save_s: float
    transfer_s: float
    restore_s: float
    bytes: int
    error: str | None = None
    reason: str | None = None  # why it fell back, in one word (metrics label): timeout, relay, checksum, ...
