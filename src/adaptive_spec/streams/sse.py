"""An incremental Server-Sent Events parser that accepts any split of the byte stream."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """One dispatched event: its `event` name ("" when the stream named none) and its joined `data` lines."""

    event: str
    data: str


class SSEParser:
    """Feed raw bytes as they arrive; get back the events they complete.

    Follows the WHATWG event-stream rules: lines end in CRLF, LF or CR; a blank line dispatches; a line starting
    with ':' is a comment; a field without ':' has an empty value; one space after ':' is dropped. There is no
    line-length limit: a partial line is kept until its end arrives.
    """

    __slots__ = ("_buf", "_data", "_event", "_has_data", "_pending_cr")

    def __init__(self) -> None:
        self._buf = b""
        self._pending_cr = False
        self._event = ""
        self._data: list[str] = []
        self._has_data = False

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if not chunk:
            return []
        if self._pending_cr:
            # A CR ended the previous chunk: a LF at the start of this one belongs to that line ending.
            self._pending_cr = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        buf = self._buf + chunk if self._buf else chunk
        if b"\r" in buf:
            if buf.endswith(b"\r"):
                self._pending_cr = True
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        lines = buf.split(b"\n")
        self._buf = lines.pop()
        events: list[SSEEvent] = []
        for line in lines:
            event = self._line(line)
            if event is not None:
                events.append(event)
        return events

    def close(self) -> list[SSEEvent]:
        """End of stream: an unterminated last line is processed, but an event without its blank line is dropped
        (as the spec says); returns nothing in that case, so callers can tell a truncated stream apart."""
        if self._buf:
            self._line(self._buf)
            self._buf = b""
        return []

    @property
    def pending(self) -> bool:
        """True when a partial line or an undispatched event is held: the stream stopped mid-event."""
        return bool(self._buf) or self._has_data

    def hand_over(self) -> bytes | None:
        """Stop here: the bytes of the event held so far (its lines re-encoded, then the partial line), for another
        reader to go on from; None (and nothing handed over) while a CR at a chunk's end leaves a line ending open."""
        if self._pending_cr:
            return None
        head = b"event: " + self._event.encode() + b"\n" if self._event else b""
        lines = b"".join(b"data: " + line.encode() + b"\n" for line in self._data) if self._has_data else b""
        held = head + lines + self._buf
        self._buf, self._event, self._data, self._has_data = b"", "", [], False
        return held

    def _line(self, raw: bytes) -> SSEEvent | None:
        if not raw:
            if not self._has_data:
                self._event = ""
                return None
            event = SSEEvent(self._event, "\n".join(self._data))
            self._event, self._data, self._has_data = "", [], False
            return event
        if raw[:1] == b":":
            return None
        line = raw.decode("utf-8", errors="replace")
        name, sep, value = line.partition(":")
        if sep and value[:1] == " ":
            value = value[1:]
        if name == "data":
            self._data.append(value)
            self._has_data = True
        elif name == "event":
            self._event = value
        return None


def ends_mid_event(data: bytes) -> bool:
    """Whether a stream whose last bytes are `data` (starting at an event's start) stopped in the middle of an event:
    as the parser would tell at its end (a trailing comment or `id:` line without its blank line is not)."""
    parser = SSEParser()
    parser.feed(data)
    parser.close()
    return parser.pending
