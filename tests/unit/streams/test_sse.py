from __future__ import annotations

import random

import pytest

from adaptive_spec.streams.sse import SSEEvent, SSEParser

STREAM = (
    b": comment line\n"
    b'data: {"choices":[{"delta":{"content":"he"}}]}\n\n'
    b"event: message_delta\r\n"
    b'data: {"a":1}\r\n'
    b'data: {"b":2}\r\n\r\n'
    b"data:no-space\r\r"
    b"data: \xc3\xa9t\xc3\xa9\n\n"
    b"data: [DONE]\n\n"
)
EXPECTED = [
    SSEEvent("", '{"choices":[{"delta":{"content":"he"}}]}'),
    SSEEvent("message_delta", '{"a":1}\n{"b":2}'),
    SSEEvent("", "no-space"),
    SSEEvent("", "été"),
    SSEEvent("", "[DONE]"),
]


def _parse_in_pieces(data: bytes, cuts: list[int]) -> list[SSEEvent]:
    parser = SSEParser()
    events: list[SSEEvent] = []
    last = 0
    for cut in [*sorted(cuts), len(data)]:
        events += parser.feed(data[last:cut])
        last = cut
    events += parser.close()
    assert not parser.pending
    return events


def test_whole_stream_at_once() -> None:
    assert _parse_in_pieces(STREAM, []) == EXPECTED


def test_every_single_split_point() -> None:
    for cut in range(len(STREAM) + 1):
        assert _parse_in_pieces(STREAM, [cut]) == EXPECTED, cut


@pytest.mark.parametrize("seed", range(200))
def test_random_splits(seed: int) -> None:
    rng = random.Random(seed)
    cuts = [rng.randrange(len(STREAM) + 1) for _ in range(rng.randrange(1, 30))]
    assert _parse_in_pieces(STREAM, cuts) == EXPECTED


def test_byte_by_byte() -> None:
    assert _parse_in_pieces(STREAM, list(range(len(STREAM)))) == EXPECTED


def test_no_line_length_limit() -> None:
    payload = "x" * 5_000_000
    data = f"data: {payload}\n\n".encode()
    assert _parse_in_pieces(data, [1000, 2_000_000]) == [SSEEvent("", payload)]


def test_truncated_event_is_pending_and_not_dispatched() -> None:
    parser = SSEParser()
    assert parser.feed(b'data: {"partial": tr') == []
    assert parser.pending
    assert parser.close() == []


def test_event_without_blank_line_is_pending() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: whole line\n") == []
    assert parser.pending
