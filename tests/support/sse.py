"""Streams read in tests the way the proxy reads them: through the project's own SSE parser
(adaptive_spec.streams.sse), never split by hand."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Protocol

from adaptive_spec.streams.sse import SSEEvent, SSEParser


class _Readable(Protocol):
    def read1(self, size: int = ..., /) -> bytes: ...


def events(raw: bytes) -> list[SSEEvent]:
    """The events of a whole stream (or of its tail, read on from an event's start); an event cut off before its
    blank line is not one."""
    parser = SSEParser()
    found = parser.feed(raw)
    parser.close()
    return found


def data_objects(raw: bytes) -> list[Any]:
    """The JSON objects the events of a whole stream carry (not [DONE])."""
    return [json.loads(e.data) for e in events(raw) if e.data.startswith("{")]


def stream_events(resp: _Readable) -> Iterator[SSEEvent]:
    """The events of a streamed HTTP answer (urllib's), each as soon as its bytes have arrived, to the stream's end."""
    parser = SSEParser()
    while chunk := resp.read1(65536):
        yield from parser.feed(chunk)
    parser.close()
