"""Event types of the live feed; a leaf module with no internal imports.

Every request publishes RequestStarted, then any number of DraftProgress, then exactly one of RequestFinished or
RequestFailed. Profiles publish ProfileUp / ProfileDown; the router HandoffDone
and PolicyChanged; remote prefill (`serve --pp-server`) RemotePrefillDone. A subscriber that falls behind gets
EventsDropped. `telemetry/decoding.py` reads them back from the feed (or a recorded file) as their types.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class _Event:
    at_unix: float = field(default_factory=time.time, kw_only=True)

    def to_json(self) -> dict[str, Any]:
        return {"type": type(self).__name__, **asdict(self)}


@dataclass(frozen=True, slots=True)
class RequestStarted(_Event):
    request_id: str
    api: str  # an `Api` (requests/apis.py): a plain string below `requests/` and as read back from the feed
    project: str
    profile: str
    session_id: str | None
    session_source: str | None
    stream: bool
    route: str | None = None  # how the profile was chosen: pinned, forced, estimate, stay, explore, fallback, only
    reason: str | None = None  # the routing decision's one-line reason
    moved_from: str | None = None  # the session's KV cache lived on this other profile
    client: str | None = None  # the agent, from its User-Agent (opencode, codex, aider, …)
    replica: int = 0  # which server of the profile's pool serves it


@dataclass(frozen=True, slots=True)
class DraftProgress(_Event):
    """Running totals during generation, from llama-server's per-token timings."""

    request_id: str
    profile: str
    predicted_n: int
    draft_n: int
    draft_n_accepted: int
    predicted_per_second: float
    # The text since the previous DraftProgress, in pieces marked True when inferred to come from accepted drafts;
    # only with `serve --feed-content` (the feed carries no text otherwise).
    text: list[tuple[str, bool]] | None = None


@dataclass(frozen=True, slots=True)
class RequestFinished(_Event):
    record: dict[str, Any]  # the RequestRecord, as /adaptive/requests shows it


@dataclass(frozen=True, slots=True)
class RequestFailed(_Event):
    record: dict[str, Any]


@dataclass(frozen=True, slots=True)
class RequestCounted(_Event):
    """A request's record once llama-server's own counters said what an answer not seen to its end cost (a client
    that hung up mid-stream, an answer with usage and no timings): it replaces the record its RequestFinished or
    RequestFailed carried; `before` is that record's timings ({}: it had none)."""

    record: dict[str, Any]
    before: dict[str, Any]


@dataclass(frozen=True, slots=True)
class SessionUpdated(_Event):
    """A turn was folded into a session's statistics (figures prefixed est_ are estimates)."""

    session_id: str
    project: str
    turn: dict[str, Any]
    est_accepted_share_ewma: float | None
    request_id: str | None = None  # the request whose response this turn folded in


@dataclass(frozen=True, slots=True)
class ProfileUp(_Event):
    profile: str
    base_url: str
    replica: int = 0  # which server of the profile's pool (0 for a profile of one server)


@dataclass(frozen=True, slots=True)
class ProfileDown(_Event):
    profile: str
    base_url: str
    reason: str
    replica: int = 0
    profile_down: bool = True  # every replica of the profile is down (False: others of its pool still serve)


@dataclass(frozen=True, slots=True)
class HandoffDone(_Event):
    """A session moved profiles: its KV slot was saved on one and restored on the other (or that failed, and the
    new profile re-prefills)."""

    session_id: str
    from_profile: str
    to_profile: str
    ok: bool
    tokens: int
    save_s: float
    restore_s: float
    error: str | None
    from_replica: int = 0  # the servers of the two profiles' pools (a move between replicas of one profile too)
    to_replica: int = 0


@dataclass(frozen=True, slots=True)
class RemotePrefillDone(_Event):
    """A prompt was prefilled on `serve --pp-server` and its KV restored here, or that failed (`reason`: why, in
    one word) and the local profile prefills it."""

    session_id: str | None
    profile: str
    relay: str
    ok: bool
    reason: str | None
    tokens: int
    bytes: int
    remote_prefill_s: float
    save_s: float
    transfer_s: float
    restore_s: float
    error: str | None


@dataclass(frozen=True, slots=True)
class SessionPinned(_Event):
    """A session was pinned to a profile (its next turns go there, its KV follows), or, with None, unpinned."""

    session_id: str
    profile: str | None


@dataclass(frozen=True, slots=True)
class PolicyChanged(_Event):
    """A policy file was reloaded, or found bad (the last good version stays in force)."""

    message: str


@dataclass(frozen=True, slots=True)
class EventsDropped(_Event):
    """This subscriber was too slow: `count` of the oldest events were dropped for it."""

    count: int


Event = (
    RequestStarted
    | DraftProgress
    | RequestFinished
    | RequestFailed
    | RequestCounted
    | SessionUpdated
    | ProfileUp
    | ProfileDown
    | HandoffDone
    | RemotePrefillDone
    | SessionPinned
    | PolicyChanged
    | EventsDropped
)
