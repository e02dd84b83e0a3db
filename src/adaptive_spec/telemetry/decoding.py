"""Reading the proxy's own values back from JSON: a feed message as its event type (`decode_event`), a request record as
a `RequestRecord` (`decode_record`).

Lenient both ways, so a TUI of one version reads a proxy of another: fields it does not know are ignored; a missing
field, or one of the wrong JSON type, takes its default, or the empty value of its type (0, "", False, None, {}) when it
has none. Pure."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import MISSING, fields
from typing import Any, TypeVar, get_args

from adaptive_spec.telemetry.events import Event
from adaptive_spec.telemetry.records import RequestRecord, Timings


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
    "int | None": (lambda v: None if isinstance(w := _whole(v), _Absent) else w, _none),
    "dict[str, Any] | None": (lambda v: dict(v) if isinstance(v, Mapping) else None, _none),
    "Timings | None": (lambda v: _timings(v) if isinstance(v, Mapping) else None, _none),
}


_FieldReader = tuple[str, Callable[[Any], Any], Callable[[], Any]]


def _field_readers(cls: type[Any]) -> tuple[_FieldReader, ...]:
    """(name, reader, maker of the value when absent) for each field; a field type without a reader fails at
    import, not when the first such event arrives."""
    readers = []
    for f in fields(cls):
        annotation = str(f.type)
        if annotation not in _READERS:
            raise TypeError(f"cannot decode {cls.__name__}.{f.name}: {annotation}")
        read, empty = _READERS[annotation]
        if f.name == "at_unix":
            empty = float  # the time a message is read is not when its event happened: 0.0 says "not known"
        elif f.default is not MISSING:
            empty = _constant(f.default)
        readers.append((f.name, read, empty))
    return tuple(readers)


def _constant(value: Any) -> Callable[[], Any]:
    return lambda: value


_T = TypeVar("_T")
_DECODERS: dict[str, tuple[type[Event], tuple[_FieldReader, ...]]] = {
    cls.__name__: (cls, _field_readers(cls)) for cls in get_args(Event)
}
_TIMINGS: tuple[_FieldReader, ...] = _field_readers(Timings)
_RECORD: tuple[_FieldReader, ...] = _field_readers(RequestRecord)


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
    return _decode(cls, readers, data)


def _timings(data: Mapping[str, Any]) -> Timings:
    return _decode(Timings, _TIMINGS, data)


def decode_record(data: Mapping[str, Any]) -> RequestRecord:
    """A request record as /adaptive/requests, the feed's RequestFinished/RequestFailed and a trace carry it
    (`RequestRecord.to_json`), read back as the same lenient way as `decode_event`."""
    return _decode(RequestRecord, _RECORD, data)


def _decode(cls: type[_T], readers: tuple[_FieldReader, ...], data: Mapping[str, Any]) -> _T:
    values: dict[str, Any] = {}
    for name, read, empty in readers:
        value = read(data[name]) if name in data else _ABSENT
        values[name] = empty() if isinstance(value, _Absent) else value
    return cls(**values)
