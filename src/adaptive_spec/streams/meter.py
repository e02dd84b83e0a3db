"""`ResponseMeter`: what one response tells about itself as it passes (token arrival times, timings, usage, the reply's
text, the server's own error, the stream's end), read event by event while the times matter and in batches after that.

Pure: the caller passes the clock readings."""

from __future__ import annotations

import re
from typing import Any

import orjson

from adaptive_spec.streams.output import LiveText, OutputCollector, body_output, event_output
from adaptive_spec.streams.sse import SSEEvent, SSEParser, ends_mid_event
from adaptive_spec.streams.timings import (
    END_EVENTS,
    as_int,
    chat_delta_text,
    find_usage,
    generated_pieces,
    loads_or_none,
    parse_timings,
    raw_timings,
    timings_from_usage,
)
from adaptive_spec.telemetry.records import Timings


class ResponseMeter:
    """Accumulates what one response tells about itself: token arrival times, timings, an upstream error.

    The caller passes a monotonic clock reading in milliseconds with each piece, so this stays free of I/O. Events
    are read one by one (`on_event`) while their arrival times matter; after that a stream's bytes may be handed
    over as they came (`keep`) and are read in one batch when the meter is asked for what they say (its output,
    timings, error or end), so the relay does nothing per chunk but pass them on.
    """

    __slots__ = (
        "_complete",
        "_error",
        "_kept",
        "_kept_size",
        "_output",
        "_pieces",
        "_raw",
        "_sse",
        "_tail",
        "_timings",
        "_usage",
        "first_token_ms",
        "live",
        "second_token_ms",
    )

    def __init__(self) -> None:
        self._output = OutputCollector()
        self.live: LiveText | None = None  # set when the live feed carries the text (serve --feed-content)
        # True once the stream's own end marker arrived: a client may hang up right after it, and lose nothing.
        self._complete = False
        # The latest event's raw `timings`, read into a Timings only when asked for (every chunk carries one when
        # per-token timings are on: parsing each cost a fifth of the relay's per-chunk work).
        self._raw: dict[str, Any] | None = None
        self._timings: Timings | None = None
        self._usage: dict[str, Any] = {}
        self.first_token_ms: float | None = None
        self.second_token_ms: float | None = None
        self._error: str | None = None
        self._pieces = 0
        self._kept: list[bytes] = []  # stream bytes handed over by `keep`, not read yet
        self._kept_size = 0
        self._tail = b""  # the kept bytes' last event, not complete yet
        self._sse: SSEParser | None = None  # reads the kept bytes once they show CR line endings

    # What the response said: reading any of these first reads the bytes kept so far.

    @property
    def output(self) -> OutputCollector:
        self._digest()
        return self._output

    @property
    def complete(self) -> bool:
        self._digest()
        return self._complete

    @property
    def error(self) -> str | None:
        """The error the server's answer carried (an error event, or an `error` object); the proxy's own verdict on
        the request is its `Outcome`."""
        self._digest()
        return self._error

    @property
    def pieces(self) -> int:
        """Pieces of generated output read one by one so far (events kept as bytes are not counted)."""
        return self._pieces

    @property
    def partial(self) -> bool:
        """The kept bytes end in the middle of an event."""
        self._digest()
        if self._sse is not None:
            return self._sse.pending
        return bool(self._tail) and ends_mid_event(self._tail)

    def on_event(self, event: SSEEvent, now_ms: float) -> dict[str, Any] | None:
        """Take in one stream event; returns its parsed JSON object (None if it is not one), so a caller that
        re-encodes the stream need not parse it again."""
        data = event.data
        if data == "[DONE]" or event.event in END_EVENTS:
            self._complete = True
        if not data or data == "[DONE]":
            return None
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(obj, dict):
            return None
        pieces = self._absorb(obj, event.event == "error")
        if pieces:
            if self._pieces == 0:
                self.first_token_ms = now_ms
            if self._pieces <= 1 and self._pieces + pieces >= 2:
                self.second_token_ms = now_ms
            self._pieces += pieces
        return obj

    def keep(self, chunk: bytes) -> None:
        """Stream bytes to read later, in one batch: the events that follow those given to `on_event`."""
        self._kept.append(chunk)
        self._kept_size += len(chunk)
        if self._kept_size > _KEEP_LIMIT:  # a long answer is read a block at a time: memory stays bounded
            self._digest()

    def _absorb(self, obj: dict[str, Any], error_event: bool) -> int:
        """One event's object into the output, timings, usage and error; returns its pieces of generated output."""
        ids: list[str] = []
        text = chat_delta_text(obj)
        if text is not None:  # the commonest event, read in one step (the same result as the general readers)
            texts, pieces = [text], int(bool(text))
        else:
            texts, ids = event_output(obj)
            pieces = generated_pieces(obj)
        self._output.add(texts, ids)
        self._take(obj)
        if self.live is not None:
            accepted = as_int(self._raw.get("draft_n_accepted")) if self._raw is not None else None
            self.live.add("".join(texts), accepted)
        if error_event or "error" in obj:
            self._error = _error_text(obj)
        return pieces

    def _digest(self) -> None:
        """Read the kept bytes' complete events (a partial last one waits for the rest)."""
        if not self._kept:
            return
        data = self._tail + b"".join(self._kept)
        self._kept, self._kept_size = [], 0
        if self._sse is not None or b"\r" in data:  # CR line endings: read as the spec says, from here on
            self._tail = b""
            self._sse = self._sse or SSEParser()
            self._read_events(self._sse.feed(data))
            return
        end = data.rfind(b"\n\n")
        if end < 0:
            self._tail = data
            return
        self._tail = data[end + 2 :]
        lines = _data_lines(data[:end])
        if lines is None:  # not one `data: ` line an event: read as the spec says
            self._read_events(SSEParser().feed(data[: end + 2]))
            return
        body, done, count = lines
        self._complete = self._complete or done
        if not self._read_plain(body, count):
            self._read_values(body, count)

    def _read_plain(self, body: bytes, count: int) -> bool:
        """The block's events by one regular expression: llama-server's plain text chunks (one choice, a delta with
        only `content`, no finish) give their text strings, decoded all at once; any other event is parsed and read
        by the general readers, in its place. False (nothing read) when the block is not that shape."""
        rows = _PLAIN_OR_OTHER.findall(body)
        if len(rows) != count:
            return False
        # A plain chunk that says more than its text is read by the general readers. A stream's plain chunks mostly
        # end alike (the same id, model and creation time): each distinct ending is looked at once.
        rests = {rest for _, rest, _ in rows}
        if any(_NOT_PLAIN_KEYS.search(rest) for rest in rests):
            return False
        # Each distinct ending must end a JSON object (an event that is not JSON says nothing): decoded once each.
        ends = [b'{"_":0,' + rest for rest in rests if rest]
        checked = loads_or_none(b"[" + b",".join(ends) + b"]") if ends else []
        if type(checked) is not list or len(checked) != len(ends):
            return False
        strings = [content for content, rest, _ in rows if rest]
        if strings:
            decoded = loads_or_none(b'["' + b'","'.join(strings) + b'"]')
            if type(decoded) is not list or len(decoded) != len(strings):
                return False
        else:
            decoded = []
        texts: list[str] = []
        next_text = iter(decoded).__next__
        last_timings = -1  # the block's last timings are the ones that count: a plain chunk's, or another's
        for i, (_, rest, other) in enumerate(rows):
            if rest:
                text = next_text()
                if text:
                    texts.append(text)
                continue
            self._output.add(texts, [])
            texts = []
            if other == b"[DONE]":
                self._complete = True
                continue
            obj = loads_or_none(other)
            if type(obj) is dict:
                self._absorb(obj, False)
                if raw_timings(obj) is not None:
                    last_timings = i
        self._output.add(texts, [])
        for i in range(len(rows) - 1, last_timings, -1) if any(b'"timings"' in rest for rest in rests) else ():
            content, rest, _ = rows[i]
            if rest and b'"timings"' in rest:
                found = raw_timings(loads_or_none(_PLAIN_HEAD + content + b'"}}],' + rest))
                if found is not None:  # else the bytes named timings without holding them: look further back
                    self._raw, self._timings = found, None
                    break
        return True

    def _read_values(self, body: bytes, count: int) -> None:
        """The block's events as one JSON array of their payloads (one decode), each read in its place."""
        values = loads_or_none(b"[" + body[6:].replace(b"\n\ndata: ", b",") + b"]") if body else []
        if type(values) is not list or len(values) != count:  # not one JSON value a `data: ` line
            self._read_events(SSEParser().feed(body + b"\n\n"))
            return
        texts: list[str] = []
        for obj in values:
            if type(obj) is not dict:
                continue
            text = chat_delta_text(obj)
            if text is not None and "usage" not in obj and "error" not in obj:
                if text:
                    texts.append(text)
            else:  # any other event, in its place: read by the general readers
                self._output.add(texts, [])
                texts = []
                self._absorb(obj, False)
        self._output.add(texts, [])
        for obj in reversed(values):  # the block's last timings are the ones that count
            last = raw_timings(obj)
            if last is not None:
                self._raw, self._timings = last, None
                break

    def _read_events(self, events: list[SSEEvent]) -> None:
        for event in events:
            if event.data == "[DONE]" or event.event in END_EVENTS:
                self._complete = True
            obj = loads_or_none(event.data) if event.data and event.data != "[DONE]" else None
            if isinstance(obj, dict):
                self._absorb(obj, event.event == "error")

    def on_body(self, body: bytes) -> None:
        """A whole non-streamed response body."""
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            return
        self._take(obj)
        self._output.add(*body_output(obj))
        if isinstance(obj, dict) and "error" in obj:
            self._error = _error_text(obj)

    def _take(self, obj: Any) -> None:
        found = raw_timings(obj)
        if found is not None:
            self._raw, self._timings = found, None
        usage = find_usage(obj)
        if usage:
            # Anthropic streams split usage between message_start and message_delta: merge them.
            self._usage.update(usage)

    @property
    def timings(self) -> Timings | None:
        """llama-server's own timings; else counts from `usage` (flagged `from_usage`); else None."""
        self._digest()
        if self._timings is None and self._raw is not None:
            self._timings = parse_timings(self._raw)
        if self._timings is not None:
            return self._timings
        return timings_from_usage(self._usage) if self._usage else None


# Kept stream bytes are read once they pass this size, so a long answer never holds more of them.
_KEEP_LIMIT = 1024 * 1024


def _data_lines(block: bytes) -> tuple[bytes, bool, int] | None:
    """A block of events that are one `data: ` line each (llama-server's): the block without its `[DONE]`, whether
    it ended in one, and how many events are left; None for any other shape."""
    if block.endswith(b"data: [DONE]"):
        block, done = block[: -len(b"data: [DONE]")].rstrip(b"\n"), True
    else:
        done = False
    if not block:
        return b"", done, 0
    # Every line break is part of an event separator followed by `data: `: each event is one data line.
    separators = block.count(b"\n\ndata: ")
    if block[:6] != b"data: " or b"\r" in block or block.count(b"\n") != 2 * separators:
        return None
    return block, done, separators + 1


# llama-server's chat chunk of plain text, up to its content string (its other fields follow the choices).
_PLAIN_HEAD = b'{"choices":[{"finish_reason":null,"index":0,"delta":{"content":"'
# Each event of a block of one-line events, in order: (content string as JSON, rest, b"") for a plain text chunk
# (the content string's escapes are whole: it ends at the first unescaped quote); (b"", b"", payload) for any other.
_PLAIN_OR_OTHER = re.compile(
    rb"data: (?:" + re.escape(_PLAIN_HEAD) + rb'([^"\\\n]*+(?:\\.[^"\\\n]*+)*+)"\}\}\],([^\n]*\})|([^\n]*+))(?:\n\n|\Z)'
)
# Keys a plain chunk may not carry after its choices: each is read by the general readers (in a string value these
# bytes cannot occur unescaped, so finding them errs only towards the general readers).
_NOT_PLAIN_KEYS = re.compile(rb'"(?:usage|error|response|message|choices)"')


def _error_text(obj: dict[str, Any]) -> str:
    err = obj.get("error", obj)
    if isinstance(err, dict):
        message = err.get("message")
        if isinstance(message, str):
            return message
    return str(err)[:500]
