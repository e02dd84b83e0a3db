"""What the relay does with each chunk of a streamed answer: the bytes its client gets, and what the meter reads.

Every event is read as it arrives while its arrival time matters (up to the second piece of generated output) and
while the live feed shows the text. After that the stream is passed on as it came and its bytes are handed to the
meter, which reads them in one batch when asked (after the answer has gone out): the relay does nothing per chunk
but write it. Per-token timings the client did not ask for are cut out of each event's bytes (llama-server puts a
flat `timings` object last in every chunk) instead of re-encoding the event, once the stream's first events showed
that cutting gives exactly what re-encoding gives.
"""

from __future__ import annotations

from typing import Any

import orjson

from adaptive_spec.streams.meter import ResponseMeter
from adaptive_spec.streams.sse import SSEEvent, SSEParser, ends_mid_event
from adaptive_spec.streams.timings import is_final_chunk, without_progress_timings

_TIMINGS_KEY = b',"timings":{'
_NOT_FINISHED = b'"finish_reason":null'


def cut_progress_timings(event: bytes, end: int | None = None) -> bytes | None:
    """One event's bytes (`data: {...}` or its JSON alone; up to `end`) without the `timings` of a chunk that is not
    the last; None when they hold none to cut: no unfinished choice, or no flat `timings` object closing the event."""
    end = len(event) if end is None else end
    i = event.rfind(_TIMINGS_KEY, 0, end)
    if i < 0 or event.find(b"}", i, end) != end - 2 or event[end - 1] != 0x7D:  # 0x7D: "}"
        return None
    if event.find(b"{", i + len(_TIMINGS_KEY), end) >= 0 or event.find(_NOT_FINISHED, 0, i) < 0:
        return None
    return event[:i] + b"}"


class StreamTap:
    """Feed each chunk of an SSE answer as it arrives; write what it returns to the client."""

    __slots__ = (
        "_batched",
        "_can_batch",
        "_carry",
        "_cr",
        "_cuttable",
        "_end",
        "_meter",
        "_parser",
        "_reencode",
        "_strip",
    )

    def __init__(self, meter: ResponseMeter, *, strip: bool) -> None:
        """`strip`: remove the per-token timings the proxy asked for on the client's behalf."""
        self._meter = meter
        self._strip = strip
        self._can_batch = meter.live is None  # live text is read event by event, for the feed
        self._batched = False
        self._parser = SSEParser()
        self._carry = b""  # batched and stripping: the start of an event whose end has not come yet
        self._cr = False  # a CR was seen: events are not cut from bytes split at blank lines
        self._reencode: SSEParser | None = None  # batched, stripping, and a CR came: re-encode from here on
        self._end = b""  # the last two bytes fed
        # Stripping: whether cutting bytes gave what re-encoding gives, for every event checked so far.
        self._cuttable: bool | None = None

    @property
    def batched(self) -> bool:
        return self._batched

    @property
    def passes_through(self) -> bool:
        """From here on each chunk is sent as it came and kept for the meter: the relay may do that itself, then
        tell `passed` which bytes went by last."""
        return self._batched and not self._strip

    def passed(self, last: tuple[bytes, bytes]) -> None:
        """The relay passed chunks on by itself (`passes_through`); `last`: the two it passed last (b"" if fewer)."""
        for chunk in last:
            if chunk:
                self._end = chunk[-2:] if len(chunk) >= 2 else (self._end + chunk)[-2:]

    def feed(self, chunk: bytes, now_ms: float) -> bytes:
        """The bytes to send on for `chunk` (b"" while an event is incomplete and timings may have to be cut)."""
        self._end = chunk[-2:] if len(chunk) >= 2 else (self._end + chunk)[-2:]
        if self._strip and not self._cr:  # only cutting needs to know (the meter reads CR streams on its own)
            self._cr = b"\r" in chunk
        if self._batched:
            self._meter.keep(chunk)
            return self._cut(chunk) if self._strip else chunk
        if not self._can_batch:
            return self._read(chunk, now_ms)
        # Event by event, so that the rest of a chunk that brings many (a fast server) goes to the batch.
        out = b""
        pos = 0
        while pos < len(chunk):
            nxt = chunk.find(b"\n\n", pos)
            stop = len(chunk) if nxt < 0 else nxt + 2
            out += self._read(chunk[pos:stop], now_ms)
            pos = stop
            if self._switch():
                rest = chunk[pos:]
                if rest:
                    self._meter.keep(rest)
                    out += self._cut(rest) if self._strip else rest
                break
        return out if self._strip else chunk

    def _read(self, part: bytes, now_ms: float) -> bytes:
        """Read the events `part` completes; the bytes to send for it."""
        events = self._parser.feed(part)
        parsed = [self._meter.on_event(event, now_ms) for event in events]
        if not self._strip:
            return part
        self._check_cuts(events, parsed)
        return without_progress_timings(events, parsed) if events else b""

    def _switch(self) -> bool:
        """Whether the rest is read in a batch: from the second piece of output on, once the timings to strip (if
        any) were seen to be cut right. The event being read is handed over to the meter with the rest."""
        if self._meter.pieces < 2 or (self._strip and (self._cuttable is not True or self._cr)):
            return False
        held = self._parser.hand_over()
        if held is None:
            return False
        self._batched = True
        if held:  # already sent unless stripping
            self._meter.keep(held)
            self._carry = held if self._strip else b""
        return True

    def close(self) -> bool:
        """End of stream; True when it stopped in the middle of an event."""
        if not self._batched:
            self._parser.close()
            return self._parser.pending
        if self._reencode is not None:
            self._reencode.close()
            return self._reencode.pending
        if self._carry:
            return ends_mid_event(self._carry)
        # A stream that ends in a blank line ends on an event's end (read no further to know it).
        return self._end != b"\n\n" and self._meter.partial

    def _check_cuts(self, events: list[SSEEvent], parsed: list[dict[str, Any] | None]) -> None:
        for event, obj in zip(events, parsed, strict=True):
            if obj is None or "timings" not in obj or is_final_chunk(obj):
                continue
            cut = cut_progress_timings(event.data.encode()) if not event.event and "\n" not in event.data else None
            same = cut is not None and orjson.loads(cut) == {k: v for k, v in obj.items() if k != "timings"}
            self._cuttable = same and self._cuttable is not False

    def _cut(self, chunk: bytes) -> bytes:
        data = self._carry + chunk if self._carry else chunk
        if self._reencode is not None or self._cr:  # CR line endings after all: parse and re-encode from here on
            self._carry = b""
            self._reencode = self._reencode or SSEParser()
            parsed = self._reencode.feed(data)
            return without_progress_timings(parsed) if parsed else b""
        last = data.find(b"\n\n")
        if last == len(data) - 2 and data.find(b"\n", 0, last) < 0:  # one one-line event, whole: the commonest
            self._carry = b""
            cut = cut_progress_timings(data, len(data) - 2)
            return data if cut is None else cut + b"\n\n"
        end = data.rfind(b"\n\n") + 2
        if end < 2:
            self._carry = data
            return b""
        self._carry = data[end:]
        if _TIMINGS_KEY not in data:
            return data[:end]
        pieces = data[: end - 2].split(b"\n\n")
        for k, piece in enumerate(pieces):
            if b"\n" in piece:  # several lines (an event name, data split over lines): re-encoded, as the spec reads it
                if b'"timings"' in piece:
                    pieces[k] = without_progress_timings(SSEParser().feed(piece + b"\n\n"))[:-2]
                continue
            cut = cut_progress_timings(piece)
            if cut is not None:
                pieces[k] = cut
        return b"\n\n".join(pieces) + b"\n\n"
