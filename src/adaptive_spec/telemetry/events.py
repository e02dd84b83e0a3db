"""Event types of the live feed; a leaf module with no internal imports.

Every request publishes RequestStarted, then any number of DraftProgress, then exactly one of RequestFinished or
RequestFailed. Profiles publish ProfileUp / ProfileDown; the router HandoffDone
and PolicyChanged; remote prefill (`serve --pp-server`) RemotePrefillDone. A subscriber that falls behind gets
EventsDropped. `decode_event` reads one back from the feed (or a recorded file) as its type.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, get_args


@dataclass(frozen=True, slots=True)
class _Event:
    at_unix: float = field(default_factory=time.time, kw_only=True)

    def to_json(self) -> dict[str, Any]:
        return {"type": type(self).__name__, **asdict(self)}


@dataclass(frozen=True, slots=True)
class RequestStarted(_Event):
    request_id: str
    api: str
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
    | SessionUpdated
    | ProfileUp
    | ProfileDown
    | HandoffDone
    | RemotePrefillDone
    | SessionPinned
    | PolicyChanged
    | EventsDropped
)


class _Absent:
    """A value that does not fit its field (or no value): the field takes its default."""


_ABSENT = _Absent()


def _number(value: Any) -> float | _Absent:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else _ABSENT


def _number_or_none(value: Any) -> float | None:
    number = _number(value)
    return None if isinstance(number, _Absent) else number


def _whole(value: Any) -> int | _Absent:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else _ABSENT


def _text_pieces(value: Any) -> list[tuple[str, bool]] | None:
    if not isinstance(value, list):
        return None
    return [(str(p[0]), bool(p[1])) for p in value if isinstance(p, list | tuple) and len(p) == 2]


def _none() -> None:
    return None


# Each field annotation the events use: how a JSON value is read into it, and what makes the value of a field
# without a default when a message lacks it (a new one each time: decoded events share no container).
_READERS: dict[str, tuple[Callable[[Any], Any], Callable[[], Any]]] = {
    "str": (lambda v: v if isinstance(v, str) else _ABSENT, str),
    "str | None": (lambda v: v if isinstance(v, str) else None, _none),
    "int": (_whole, int),
    "float": (_number, float),
    "float | None": (_number_or_none, _none),
    "bool": (lambda v: v if isinstance(v, bool) else _ABSENT, bool),
    "dict[str, Any]": (lambda v: dict(v) if isinstance(v, Mapping) else _ABSENT, dict),
    "list[tuple[str, bool]] | None": (_text_pieces, _none),
}


_FieldReader = tuple[str, Callable[[Any], Any], Callable[[], Any]]


def _field_readers(cls: type[Event]) -> tuple[_FieldReader, ...]:
    """(name, reader, maker of the value when absent) for each field; a field type without a reader fails at
    import, not when the first such event arrives."""
    readers = []
    for f in fields(cls):
        annotation = str(f.type)
        if annotation not in _READERS:
            raise TypeError(f"decode_event cannot read {cls.__name__}.{f.name}: {annotation}")
        read, empty = _READERS[annotation]
        if f.name == "at_unix":
            empty = float  # the time a message is read is not when its event happened: 0.0 says "not known"
        elif f.default is not MISSING:
            empty = _constant(f.default)
        readers.append((f.name, read, empty))
    return tuple(readers)


def _constant(value: Any) -> Callable[[], Any]:
    return lambda: value


_DECODERS: dict[str, tuple[type[Event], tuple[_FieldReader, ...]]] = {
    cls.__name__: (cls, _field_readers(cls)) for cls in get_args(Event)
}


def decode_event(kind: str, data: Mapping[str, Any]) -> Event | None:
    """One feed message (an SSE event of /adaptive/events, or a line of a recorded feed: its event name and JSON
    object) as its event type; None for a kind this version does not know, so a newer proxy's events are skipped.

    Lenient both ways: fields it does not know are ignored; a missing field, or one of the wrong JSON type, takes
    its default, or the empty value of its type (0, "", False, None, {}) when it has none; a missing `at_unix`
    reads 0.0 (not known).
    """
    decoder = _DECODERS.get(kind)
    if decoder is None:
        return None
    cls, readers = decoder
    values: dict[str, Any] = {}
    for name, read, empty in readers:
        value = read(data[name]) if name in data else _ABSENT
        values[name] = empty() if isinstance(value, _Absent) else value
    return cls(**values)
