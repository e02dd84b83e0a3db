"""The forward counts all proxies keep (what the head stores' save and restore guards compare), in both stores: the
in-process one and Redis (a real redis-server). A booking counts its request and returns the counts in its own round
trip; a request that books no slot counts on every slot; a mark taken while another proxy's request could still use
that slot cannot be trusted; a flushed store starts a new epoch; a value that is not a count reads as none."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from adaptive_spec.kv.heads.activity import Counted
from adaptive_spec.shared_state.redis_store import PREFIX, RedisStore
from adaptive_spec.shared_state.store import MemoryStore, SharedStore
from adaptive_spec.shared_state.values import Booked, Booking, counted
from tests.support.processes.redis import RedisServer

SERVER = "http://10.0.0.1:8080"


class Pair:
    """Two proxies' stores of one shared state, and how to flush it."""

    def __init__(self, a: SharedStore, b: SharedStore, flush: object) -> None:
        self.a, self.b, self._flush = a, b, flush

    def flush(self) -> None:
        assert callable(self._flush)
        self._flush()


@pytest_asyncio.fixture(params=["memory", "redis"])
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
    if request.param == "memory":
        memory = MemoryStore()
        yield Pair(memory, memory, memory.flush)
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    server.client().flushall()
    a, b = RedisStore(server.url), RedisStore(server.url)
    yield Pair(a, b, lambda: server.client().flushall())
    await a.close()
    await b.close()


def _mark(booked: Booked) -> Counted:
    assert booked.ok and booked.counted is not None, booked
    return booked.counted


@pytest.mark.asyncio
async def test_a_booking_counts_its_request_and_a_guard_sees_the_other_proxys_requests(pair: Pair) -> None:
    turn = _mark(await pair.a.book(Booking(SERVER, 0, "a", "r1", "s1"), 30, False))
    assert (turn.forwards, turn.unnamed, turn.slot, turn.in_slot, turn.contested) == (1, 0, 0, 1, False)
    assert turn.unchanged(await pair.b.forwards(SERVER, 0), 0)
    assert turn.unchanged(await pair.b.forwards(SERVER, None), None)
    await pair.a.release(Booking(SERVER, 0, "a", "r1", "s1"))
    # b's request to slot 1: slot 0 still holds the turn, but a guard that knows no slot cannot tell.
    await pair.b.book(Booking(SERVER, 1, "b", "r2", "s2"), 30, False)
    assert turn.unchanged(await pair.a.forwards(SERVER, 0), 0)
    assert not turn.unchanged(await pair.a.forwards(SERVER, None), None)
    await pair.b.release(Booking(SERVER, 1, "b", "r2", "s2"))
    # A request that booked no slot (not routed) may use any: slot 0's mark is spent.
    await pair.b.forwarded(SERVER)
    now = await pair.a.forwards(SERVER, 0)
    assert now is not None and (now.forwards, now.unnamed, now.in_slot) == (3, 1, 1)
    assert not turn.unchanged(now, 0)
    # So is one of a request booked on that slot, or on none.
    again = _mark(await pair.a.book(Booking(SERVER, 0, "a", "r3", "s1"), 30, False))
    await pair.b.book(Booking(SERVER, -1, "b", "r4"), 30, False)
    assert not again.unchanged(await pair.a.forwards(SERVER, 0), 0)


@pytest.mark.asyncio
async def test_a_mark_taken_while_another_proxys_request_could_still_use_the_slot_is_contested(pair: Pair) -> None:
    await pair.b.book(Booking(SERVER, 1, "b", "r1", "s1"), 30, False)  # live: may reach the server after a's
    assert _mark(await pair.a.book(Booking(SERVER, 1, "a", "r2", "s2"), 30, force=True)).contested
    assert not _mark(await pair.a.book(Booking(SERVER, 0, "a", "r3", "s3"), 30, False)).contested  # another slot
    assert not _mark(await pair.a.book(Booking(SERVER, 1, "a", "r4", "s1"), 30, force=True)).contested  # its session
    # b's own live booking does not contest b's (its proxy's counts see its own requests); a's do.
    assert _mark(await pair.b.book(Booking(SERVER, 1, "b", "r5", "s4"), 30, force=True)).contested
    await pair.a.release(Booking(SERVER, 1, "a", "r2", "s2"))
    await pair.a.release(Booking(SERVER, 1, "a", "r4", "s1"))
    assert not _mark(await pair.b.book(Booking(SERVER, 1, "b", "r9", "s4"), 30, False)).contested
    await pair.b.book(Booking(SERVER, -1, "b", "r6"), 30, False)  # no slot named: it may land in any
    assert _mark(await pair.a.book(Booking(SERVER, 0, "a", "r7", "s3"), 30, False)).contested
    await pair.b.release(Booking(SERVER, -1, "b", "r6"))
    await pair.b.release(Booking(SERVER, 1, "b", "r1", "s1"))
    await pair.b.release(Booking(SERVER, 1, "b", "r5", "s4"))
    await pair.b.release(Booking(SERVER, 1, "b", "r9", "s4"))
    assert not _mark(await pair.a.book(Booking(SERVER, 1, "a", "r8", "s2"), 30, False)).contested


@pytest.mark.asyncio
async def test_a_flushed_store_starts_a_new_epoch(pair: Pair) -> None:
    turn = _mark(await pair.a.book(Booking(SERVER, 0, "a", "r1", "s1"), 30, False))
    pair.flush()
    assert await pair.a.forwards(SERVER, 0) is None  # nothing kept: no guard passes
    await pair.b.book(Booking(SERVER, 0, "b", "r2", "s2"), 30, False)  # the same counts again, from zero
    now = await pair.a.forwards(SERVER, 0)
    assert now is not None and (now.forwards, now.in_slot) == (turn.forwards, turn.in_slot)
    assert not turn.unchanged(now, 0) and not turn.unchanged(now, None)


@pytest.mark.asyncio
async def test_counts_that_are_not_counts_read_as_none(redis_server: RedisServer) -> None:
    store, raw = RedisStore(redis_server.url), redis_server.client()
    await store.forwarded(SERVER)
    assert await store.forwards(SERVER, None) is not None
    raw.hset(PREFIX + "forwards:" + SERVER, "all", "-5")
    assert await store.forwards(SERVER, None) is None
    raw.hset(PREFIX + "forwards:" + SERVER, mapping={"all": "7", "epoch": "x" * 65})
    assert await store.forwards(SERVER, None) is None
    await store.close()


@pytest.mark.parametrize(
    "raw",
    [
        [b"e", b"1", b"-1", b"2"],
        [b"e", b"1", b"0", b"1.5"],
        [b"", b"1", b"0", b"1"],
        [None, b"1", b"0", b"1"],
        [b"e", True, 0, 1],
        [b"e", b"9" * 20, 0, 1],
        [b"e", 1, 0],
    ],
)
def test_a_count_is_read_only_as_digits_or_ints(raw: list[object]) -> None:
    assert counted(raw, 0) is None


def test_counts_read_from_what_the_store_holds() -> None:
    assert counted([b"e", b"3", None, 2], 1, 1) == Counted("e", 3, 0, 1, 2, contested=True)
    assert counted(["e", 3, 0, 0], None) == Counted("e", 3, 0, None, 0)
