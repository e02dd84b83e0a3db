"""The Redis store against a real redis-server: what one proxy writes the other reads, a slot another proxy booked is
refused atomically, leases lapse on Redis's clock, a password URL works, and a stopped server is an outage at once."""

from __future__ import annotations

import asyncio
import time

import pytest

from adaptive_spec.routing.placements import Placement
from adaptive_spec.shared_state.news import HeadSaved, HeadsGone, SlotsErased
from adaptive_spec.shared_state.redis_store import RedisStore, redacted
from adaptive_spec.shared_state.store import StoreDown
from adaptive_spec.shared_state.values import Booking, Placed, SharedPlacement
from tests.support.processes.redis import RedisServer

SERVER = "http://10.0.0.1:8080"


@pytest.mark.asyncio
async def test_what_one_proxy_writes_the_other_reads(redis_server: RedisServer) -> None:
    a, b = RedisStore(redis_server.url), RedisStore(redis_server.url)
    placed = SharedPlacement(SERVER, Placement("plain", 1, 300, 2, 8.0, replica=0), time.time_ns())
    await a.place("s1", placed, 1, ttl_s=60)
    await a.served(["reply:00ff", "call:c1"], "s1", ttl_s=60)
    assert await b.sessions_of(["reply:00ff", "call:c1", "reply:absent"]) == {"reply:00ff": "s1", "call:c1": "s1"}
    assert (await b.book(Booking(SERVER, 1, "a", "r1"), lease_s=30, force=False)).ok
    reading = await b.read("s1", [SERVER, "http://10.0.0.2:8080"])
    assert reading.placement == placed
    assert reading.occupants == {SERVER: {1: "s1"}}
    assert reading.booked_elsewhere("b") == {SERVER: {1: 1}}
    assert reading.booked_elsewhere("a") == {}  # a's own, counted by a's router already
    assert redis_server.client().pttl("adaptive-spec:place:s1") > 0  # everything expires
    await a.close()
    await b.close()


@pytest.mark.asyncio
async def test_a_slot_another_proxy_holds_is_refused_until_its_lease_lapses(redis_server: RedisServer) -> None:
    a, b = RedisStore(redis_server.url), RedisStore(redis_server.url)
    assert (await a.book(Booking(SERVER, 0, "a", "r1"), lease_s=0.3, force=False)).ok
    assert (await a.book(Booking(SERVER, 0, "a", "r2"), lease_s=0.3, force=False)).ok  # its own: its router's business
    assert not (await b.book(Booking(SERVER, 0, "b", "r3"), lease_s=30, force=False)).ok
    assert (await b.book(Booking(SERVER, 1, "b", "r4"), lease_s=30, force=False)).ok  # another slot is free
    assert (await b.book(Booking(SERVER, -1, "b", "r5"), lease_s=30, force=False)).ok  # no slot named: counted only
    # Many proxies racing for one slot: exactly one gets it.
    stores = [RedisStore(redis_server.url) for _ in range(8)]
    won = await asyncio.gather(*(s.book(Booking(SERVER, 2, f"p{i}", "r"), 30, False) for i, s in enumerate(stores)))
    assert sum(b.ok for b in won) == 1
    # a stops renewing: once Redis's clock passes the lease, b books slot 0.
    deadline = time.monotonic() + 10
    while not (await b.book(Booking(SERVER, 0, "b", "r6"), lease_s=30, force=False)).ok:
        assert time.monotonic() < deadline, "a's lapsed lease still holds the slot"
        await asyncio.sleep(0.05)
    reading = await b.read(None, [SERVER])
    assert sorted(x.request for x in reading.bookings[SERVER]) == ["r", "r4", "r5", "r6"]
    await a.renew([Booking(SERVER, 0, "a", "r1")], lease_s=30)  # a renewal writes a lapsed booking again
    assert "r1" in [x.request for x in (await b.read(None, [SERVER])).bookings[SERVER]]
    await b.release(Booking(SERVER, 0, "b", "r6"))
    assert "r6" not in [x.request for x in (await b.read(None, [SERVER])).bookings[SERVER]]
    for s in [a, b, *stores]:
        await s.close()


@pytest.mark.asyncio
async def test_a_booking_places_its_session_in_the_same_step(redis_server: RedisServer) -> None:
    a, b = RedisStore(redis_server.url), RedisStore(redis_server.url)
    placed = SharedPlacement(SERVER, Placement("plain", 1, 0, 1, 0.0, replica=0), time.time_ns())
    assert (await a.book(Booking(SERVER, 1, "a", "r1", "s1"), 30, False, Placed(placed, 1, ttl_s=60))).ok
    # Refused: it writes nothing (s2 is not placed, slot 1 still holds s1).
    assert not (await b.book(Booking(SERVER, 1, "b", "r2", "s2"), 30, False, Placed(placed, 1, ttl_s=60))).ok
    await a.release(Booking(SERVER, 1, "a", "r1", "s1"))  # the turn ended: the booking went, the placement stays
    reading = await b.read("s1", [SERVER])
    assert reading.bookings == {SERVER: []}
    assert reading.placement == placed and reading.occupants == {SERVER: {1: "s1"}}
    assert (await b.read("s2", [SERVER])).placement is None
    assert 0 < redis_server.client().pttl("adaptive-spec:place:s1") <= 60_000
    assert 0 < redis_server.client().pttl("adaptive-spec:occupant:" + SERVER) <= 60_000
    assert (await b.book(Booking(SERVER, 0, "b", "r3"), 30, False)).ok  # nothing to place: a booking alone
    assert (await b.read(None, [SERVER])).occupants == {SERVER: {1: "s1"}}
    # A route read with slot 1 empty: s1 placed there since refuses it, unless forced or read with s1 there.
    assert not (await b.book(Booking(SERVER, 1, "b", "r4", "s2"), 30, False, seen="")).ok
    assert (await b.book(Booking(SERVER, 1, "b", "r5", "s2"), 30, False, seen="s1")).ok
    assert (await b.book(Booking(SERVER, 1, "b", "r6", "s3"), 30, True, seen="")).ok
    await b.release(Booking(SERVER, 1, "b", "r5", "s2"))
    await b.release(Booking(SERVER, 1, "b", "r6", "s3"))
    assert (await a.book(Booking(SERVER, 1, "a", "r7", "s1"), 30, False, seen="")).ok  # its own slot: never refused
    await a.close()
    await b.close()


@pytest.mark.asyncio
async def test_a_password_url_and_a_wrong_password(tmp_path_factory: pytest.TempPathFactory) -> None:
    server = RedisServer(tmp_path_factory.mktemp("redis-auth"), password="s3cret")
    try:
        good = RedisStore(server.url)
        assert good.label == f"redis://127.0.0.1:{server.port}/0"  # never the password
        await good.served(["reply:aa"], "s1", 60)
        assert await good.sessions_of(["reply:aa"]) == {"reply:aa": "s1"}
        bad = RedisStore(f"redis://:wrong@127.0.0.1:{server.port}/0")
        with pytest.raises(StoreDown, match=r"127\.0\.0\.1") as caught:
            await bad.sessions_of(["reply:aa"])
        assert "wrong" not in str(caught.value)
        await good.close()
        await bad.close()
    finally:
        server.stop()


@pytest.mark.asyncio
async def test_a_stopped_server_is_an_outage_and_a_restarted_one_is_used_again(redis_server: RedisServer) -> None:
    store = RedisStore(redis_server.url)
    await store.served(["reply:bb"], "s1", 60)
    redis_server.stop()
    started = time.monotonic()
    with pytest.raises(StoreDown):
        await store.read("s1", [SERVER])
    assert time.monotonic() - started < 5  # refused at once, not a hang (a generous bound: no timing claim)
    redis_server.start()
    assert await store.sessions_of(["reply:bb"]) == {}  # nothing was saved: a restart is a flush
    assert (await store.book(Booking(SERVER, 0, "a", "r1"), 30, False)).ok  # its scripts loaded again
    await store.close()


def test_redacted() -> None:
    assert redacted("rediss://user:pw@cache.internal:6380/2") == "rediss://cache.internal:6380/2"


@pytest.mark.asyncio
async def test_news_is_heard_by_a_listener_and_heads_are_kept_for_a_later_one(redis_server: RedisServer) -> None:
    a, b = RedisStore(redis_server.url), RedisStore(redis_server.url)
    saved = HeadSaved("a", "00ff00ff00ff00ff00ff00ff", {"id": "00ff00ff00ff00ff00ff00ff"}, "/heads/x.head", "t")
    await a.tell(saved, ttl_s=60)
    assert await b.published() == [saved]  # what a proxy that starts listening missed
    listening = b.listen()
    assert await anext(listening) is None  # subscribed
    await a.tell(SlotsErased("a", SERVER, True, 123), ttl_s=60)
    await a.tell(HeadsGone("a", (saved.head,)), ttl_s=60)
    assert await asyncio.wait_for(anext(listening), 5) == SlotsErased("a", SERVER, True, 123)
    assert await asyncio.wait_for(anext(listening), 5) == HeadsGone("a", (saved.head,))
    assert await b.published() == []  # gone: no longer kept
    assert (await b.read(None, [SERVER, "http://10.0.0.2:8080"])).erased == {SERVER: 123}
    assert 0 < redis_server.client().pttl("adaptive-spec:erased:" + SERVER) <= 60_000
    await listening.aclose()
    await a.close()
    await b.close()


@pytest.mark.asyncio
async def test_one_proxy_warms_a_fresh_server_its_launcher_if_it_has_one(redis_server: RedisServer) -> None:
    stores = [RedisStore(redis_server.url) for _ in range(8)]
    # Many proxies find one restarted server fresh at once: exactly one warms it, and again on its next restart.
    won = await asyncio.gather(*(s.claim_warm(SERVER, f"p{i}", 60) for i, s in enumerate(stores)))
    assert sum(won) == 1
    (winner,) = [f"p{i}" for i, w in enumerate(won) if w]
    assert await stores[0].claim_warm(SERVER, winner, 60) and not await stores[0].claim_warm(SERVER, "late", 60)
    assert 0 < redis_server.client().pttl("adaptive-spec:warm:" + SERVER) <= 60_000
    assert await stores[0].claim_warm(SERVER + "0", "late", 0.05)  # another server: its own claim
    await asyncio.sleep(0.2)
    assert await stores[0].claim_warm(SERVER + "0", "later", 60)  # that claim lapsed: a later restart's
    # A server with a launcher: warmed by it alone, every restart, whoever claimed before.
    await stores[1].launched([SERVER], "launcher", lease_s=30)
    assert await stores[2].claim_warm(SERVER, "launcher", 60)
    assert not await stores[3].claim_warm(SERVER, winner, 60)
    await stores[1].unlaunched([SERVER], "someone else")  # only its own records go
    assert not await stores[3].claim_warm(SERVER, winner, 60)
    await stores[1].unlaunched([SERVER], "launcher")
    assert await stores[3].claim_warm(SERVER, winner, 60)  # its launcher stopped: the first to claim again
    for store in stores:
        await store.close()
