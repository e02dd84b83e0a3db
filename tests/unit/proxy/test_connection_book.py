"""The connection book, pure: what it bounds (receipt of a request, never its answer), from when, and which
connection it closes past the cap; the cap fitted to the descriptor limit. The watch around it runs in
tests/integration/reliability/test_slow_clients.py."""

from __future__ import annotations

import pytest

from adaptive_spec.proxy.connection_book import ConnectionBook, ConnectionLimits, Phase, descriptor_budget


def test_the_book_bounds_receipt_not_answers() -> None:
    book: ConnectionBook[str] = ConnectionBook(ConnectionLimits(header_timeout_s=10, body_timeout_s=60))
    book.opened("slow", 0)
    book.opened("streaming", 0)
    book.headers_received("streaming", 1, body_done=True)
    book.opened("uploading", 0)
    book.headers_received("uploading", 1, body_done=False)
    assert book.expired(9.9) == []
    assert book.expired(10) == ["slow"] and book.phase("slow") is Phase.CLOSING
    assert book.expired(61) == ["uploading"]
    assert book.expired(10_000) == [] and book.phase("streaming") is Phase.BUSY


def test_the_book_times_a_kept_alive_connections_next_request_from_its_first_byte() -> None:
    book: ConnectionBook[str] = ConnectionBook(ConnectionLimits(header_timeout_s=10))
    book.opened("a", 0)
    book.headers_received("a", 1, body_done=True)
    book.answered("a", 2)
    assert book.phase("a") is Phase.IDLE and book.expired(100) == []  # idle: aiohttp's keep-alive timer's
    book.bytes_received("a", 100)
    assert book.phase("a") is Phase.HEADERS and book.expired(109) == [] and book.expired(110) == ["a"]
    book.opened("b", 0)
    book.headers_received("b", 1, body_done=True)
    book.bytes_received("b", 2)  # pipelined: the next request began while this one was answered
    book.answered("b", 50)
    assert book.phase("b") is Phase.HEADERS and book.expired(60) == ["b"]


def test_past_the_cap_the_slowest_then_the_idlest_then_the_newcomer_is_closed() -> None:
    book: ConnectionBook[str] = ConnectionBook(ConnectionLimits(max_connections=3))
    for key, at in (("idle", 0), ("busy", 1), ("slow-body", 2)):
        book.opened(key, at)
    book.headers_received("idle", 0.5, body_done=True)
    book.answered("idle", 0.6)
    book.headers_received("busy", 1.5, body_done=True)
    book.headers_received("slow-body", 2.5, body_done=False)
    assert book.opened("new1", 3) == "slow-body"
    assert book.opened("new2", 4) == "new1"  # sending its headers since 3: slower than new2
    assert book.opened("new3", 5) == "new2"
    book.headers_received("new3", 5.1, body_done=True)
    assert book.opened("new4", 6) == "idle"
    book.headers_received("new4", 6.1, body_done=True)
    assert book.opened("new5", 7) == "new5"  # every other connection is being answered
    for closing in ("slow-body", "new1", "new2", "idle", "new5"):
        book.closed(closing)
    assert len(book) == 3


@pytest.mark.parametrize(
    ("soft", "hard", "expected"),
    [
        (1024, 524288, (1024, 2304)),  # a Linux desktop: the soft limit is raised
        (1024, 1024, (384, 1024)),  # cannot be raised: fewer connections, descriptors for their upstreams kept
        (256, None, (1024, 2304)),  # macOS: unlimited hard limit
        (65536, 65536, (1024, 65536)),
    ],
)
def test_the_cap_fits_the_descriptor_limit(soft: int, hard: int | None, expected: tuple[int, int]) -> None:
    assert descriptor_budget(1024, soft, hard) == expected
