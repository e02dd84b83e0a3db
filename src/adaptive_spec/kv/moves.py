"""What the router asks the KV layer to do, and what comes back: values only (pure).

The router decides a handoff or a remote prefill and names one of these in its route; the request path has it carried
out (`requests/carry_out.py`, through `kv/effects.py`), and the results go into the request's record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from adaptive_spec.kv.costs import PrefillRate

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
class PrefillAsk:
    """A prompt the router would prefill here: may it be prefilled on the remote server instead?"""

    at: SlotAt
    session_id: str | None
    path: str  # the upstream path and body of the request, as the remote server is to see it
    body: dict[str, Any]
    new_tokens: int
    context_tokens: int
    local: PrefillRate  # the router's prefill cost here
    slot_busy: bool  # the slot is serving another request (a restore into it now would be overwritten)


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


@dataclass(frozen=True, slots=True)
class PrefillAnswer:
    note: str  # what the reason line gains: the estimate's verdict, or why it fell back
    result: RemotePrefillResult | None  # None: not attempted (prefilled here)
