"""Two proxies' routers sharing one in-process store, driven as the request path drives them: what one placed and
booked, the other reads before routing; an outage serves on from each proxy's own state, said once; a dead proxy's
bookings lapse."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import pytest

from adaptive_spec.llama.upstreams import Upstream, UpstreamTable
from adaptive_spec.routing.contract import Completion, FixedPolicy, Route
from adaptive_spec.routing.router import Router
from adaptive_spec.sessions.grouping import SessionRegistry
from adaptive_spec.shared_state.news import HeadSaved, HeadsGone, News
from adaptive_spec.shared_state.shell import BOOKING_TRIES, SharedState, must_book
from adaptive_spec.shared_state.store import MemoryStore
from adaptive_spec.shared_state.values import Booked, Booking, Placed, Reading, SharedPlacement
from adaptive_spec.telemetry.records import Timings
from tests.support.routing import request

URLS = ("http://10.0.0.1:8080", "http://10.0.0.2:8080")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _router() -> Router:
    table = UpstreamTable([Upstream("plain", url, replica=i) for i, url in enumerate(URLS)])
    return Router(table, FixedPolicy(), {"plain": 2}, {"plain": None}, replica_slots={("plain", 0): 2, ("plain", 1): 2})


def _body(sid: str, turn: int) -> dict[str, object]:
    messages = [{"role": "user", "content": f"session {sid}: question {n}"} for n in range(turn + 1)]
    return {"model": "m", "messages": messages}


class Proxy:
    """One proxy's router and shell, routing as `requests/handler._route_shared` does."""

    def __init__(self, store: MemoryStore, clock: Clock, name: str) -> None:
        self.router, self.shared = _router(), SharedState(store, lease_s=15.0, proxy_id=name, clock=clock)
        self.count = 0

    async def start(self, sid: str, turn: int, share: bool = True) -> tuple[str, Route]:
        self.count += 1
        request_id = f"{self.shared.proxy_id}-{self.count}"
        for attempt in range(BOOKING_TRIES):
            seen = await self.shared.before_route(self.router, sid) if share else None
            route = self.router.route(request(_body(sid, turn), sid))
            assert isinstance(route, Route)
            force = must_book(self.router, route, attempt)
            if not share or await self.shared.book(self.router, route, request_id, force, seen):
                return request_id, route
            self.router.withdraw(route)
        raise AssertionError("unreachable")

    async def end(self, request_id: str, route: Route, prompt_n: int = 40) -> None:
        timings = Timings(prompt_n=prompt_n, predicted_n=8, prompt_ms=1.0, predicted_ms=1.0)
        self.router.complete(route, Completion(True, timings, "a reply"))
        self.shared.ended(self.router, request_id, route, ("a reply " + request_id, ()))
        await self.shared.settled()


def _where(route: Route) -> tuple[int, int | None]:
    return route.decision.replica, route.slot


@pytest.mark.asyncio
async def test_a_turn_routed_by_the_other_proxy_lands_where_its_kv_is() -> None:
    store, clock = MemoryStore(Clock()), Clock()
    a, b = Proxy(store, clock, "a"), Proxy(store, clock, "b")
    placed = {}
    for sid in ("s0", "s1", "s2"):  # spread over both servers by proxy a
        rid, route = await a.start(sid, 0)
        await a.end(rid, route)
        placed[sid] = _where(route)
    assert {r for r, _ in placed.values()} == {0, 1}, placed
    for sid in ("s2", "s1", "s0"):  # in another order than a's: blind, b would place them elsewhere
        rid, route = await b.start(sid, 1)
        assert _where(route) == placed[sid], (sid, route.decision.reason)
        await b.end(rid, route)
    # And back: b's placements are read by a (a's own are older than b's now).
    for sid in ("s0", "s1", "s2"):
        rid, route = await a.start(sid, 2)
        assert _where(route) == placed[sid]
        await a.end(rid, route)


@pytest.mark.asyncio
async def test_without_the_shared_state_the_other_proxy_routes_blind() -> None:
    store, clock = MemoryStore(Clock()), Clock()
    a, b = Proxy(store, clock, "a"), Proxy(store, clock, "b")
    placed = {}
    for sid in ("s0", "s1", "s2"):
        rid, route = await a.start(sid, 0)
        await a.end(rid, route)
        placed[sid] = _where(route)
    moved = 0
    for sid in ("s2", "s1", "s0"):
        rid, route = await b.start(sid, 1, share=False)
        moved += _where(route) != placed[sid]
        await b.end(rid, route)
    assert moved > 0  # what the shared state fixes


@pytest.mark.asyncio
async def test_two_proxies_never_give_two_sessions_one_slot_at_once() -> None:
    store, clock = MemoryStore(Clock()), Clock()
    a, b = Proxy(store, clock, "a"), Proxy(store, clock, "b")
    held = []
    for n in range(4):  # four sessions in flight at once, two slots on each of the two servers
        proxy = (a, b)[n % 2]
        _, route = await proxy.start(f"s{n}", 0)
        held.append((proxy.router.server_url("plain", route.decision.replica), route.slot))
    assert len(set(held)) == 4, held


class Interleaved(MemoryStore):
    """A store whose every read and booking lets the other proxies' requests run first: proxies that read the slots
    at the same moment, then book one after another."""

    async def read(self, session_id: str | None, servers: Sequence[str]) -> Reading:
        await asyncio.sleep(0)
        return await super().read(session_id, servers)

    async def book(
        self, booking: Booking, lease_s: float, force: bool, placed: Placed | None = None, seen: str | None = None
    ) -> Booked:
        await asyncio.sleep(0)
        return await super().book(booking, lease_s, force, placed, seen)


@pytest.mark.asyncio
async def test_new_sessions_arriving_at_once_at_four_proxies_each_get_a_slot_of_their_own() -> None:
    store, clock = Interleaved(Clock()), Clock()
    proxies = [Proxy(store, clock, name) for name in "abcd"]
    # Each round of reads finds the slot all of them chose booked by one: routed again, never forced into it.
    started = await asyncio.gather(*(p.start(f"s{n}", 0) for n, p in enumerate(proxies)))
    held = [(route.decision.replica, route.slot) for _, route in started]
    assert len(set(held)) == 4, [(h, route.decision.reason) for h, (_, route) in zip(held, started, strict=True)]


@pytest.mark.asyncio
async def test_a_route_that_still_waits_for_a_busy_slot_once_read_again_is_booked() -> None:
    store, clock = MemoryStore(Clock()), Clock()
    a, b = Proxy(store, clock, "a"), Proxy(store, clock, "b")
    started = [await a.start(f"s{n}", 0) for n in range(4)]  # every slot busy
    await b.shared.before_route(b.router, "s4")
    route = b.router.route(request(_body("s4", 0), "s4"))
    assert isinstance(route, Route) and b.router.waits(route)
    assert not must_book(b.router, route, 0)  # the first reading may be stale: routed again
    assert must_book(b.router, route, 1)  # read again and still waiting: it queues there, as one proxy's would
    b.router.complete(route, Completion(ok=False))
    await a.end(*started[0])  # a slot is free again: a route there is never forced
    await b.shared.before_route(b.router, "s4")
    again = b.router.route(request(_body("s4", 0), "s4"))
    assert isinstance(again, Route) and not b.router.waits(again) and not must_book(b.router, again, 1)


@pytest.mark.asyncio
async def test_a_slot_another_session_took_and_left_since_the_read_is_refused() -> None:
    store, clock = MemoryStore(Clock()), Clock()
    a, b = Proxy(store, clock, "a"), Proxy(store, clock, "b")
    seen = await b.shared.before_route(b.router, "s2")  # b reads the servers idle, and is slow to book
    stale = b.router.route(request(_body("s2", 0), "s2"))
    assert isinstance(stale, Route)
    rid, first = await a.start("s1", 0)  # meanwhile s1 is booked into that very slot, served, and released
    assert _where(first) == _where(stale)
    await a.end(rid, first)
    _, busy = await a.start("s3", 0)  # and s3 is served on the other server
    assert busy.decision.replica != first.decision.replica
    assert not await b.shared.book(b.router, stale, "b-1", force=False, seen=seen)  # s1 holds it now
    b.router.withdraw(stale)  # the slot it gave s2 is not s2's: routed again, s2 takes the one no session used
    _, again = await b.start("s2", 0)
    assert _where(again) != _where(first), again.decision.reason


@pytest.mark.asyncio
async def test_a_new_session_takes_a_slot_no_session_used_before_one_that_holds_an_idle_sessions_kv() -> None:
    store, clock = MemoryStore(Clock()), Clock()
    a, b, c = (Proxy(store, clock, name) for name in "abc")
    rid, idle = await a.start("s0", 0)
    await a.end(rid, idle)  # s0's KV stays in its slot, between turns
    await b.start("s2", 0)  # in flight on the other server
    await c.shared.before_route(c.router, None)  # c routes two new sessions from one reading
    third = c.router.route(request(_body("s3", 0), "s3"))
    first = c.router.route(request(_body("s1", 0), "s1"))
    assert isinstance(third, Route) and isinstance(first, Route)
    assert _where(first) != _where(idle), first.decision.reason  # a free slot no session used is on the other


@pytest.mark.asyncio
async def test_a_slot_booked_between_the_read_and_the_booking_is_refused() -> None:
    store, clock = MemoryStore(Clock()), Clock()
    a, b = Proxy(store, clock, "a"), Proxy(store, clock, "b")
    await a.shared.before_route(a.router, "s1")
    await b.shared.before_route(b.router, "s2")
    first = a.router.route(request(_body("s1", 0), "s1"))
    second = b.router.route(request(_body("s2", 0), "s2"))
    assert isinstance(first, Route) and isinstance(second, Route)
    assert _where(first) == _where(second)  # both read the servers idle
    assert await a.shared.book(a.router, first, "a-1", force=False)
    assert not await b.shared.book(b.router, second, "b-1", force=False)
    assert b.shared.status()["conflicts"] == 1
    b.router.complete(second, Completion(ok=False))
    _, again = await b.start("s2", 0)
    assert _where(again) != _where(first)


class LatePlacements(MemoryStore):
    """A store whose separate placement writes (`place`) wait until let through: what a loaded proxy's writes off the
    request path do, while its bookings and their releases land at once."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock)
        self.let_through = asyncio.Event()

    async def place(self, session_id: str, placement: SharedPlacement, slot: int | None, ttl_s: float) -> None:
        await self.let_through.wait()
        await super().place(session_id, placement, slot, ttl_s)


@pytest.mark.asyncio
async def test_a_booked_slot_stays_its_sessions_once_the_turn_ends_before_any_later_write() -> None:
    store, clock = LatePlacements(Clock()), Clock()
    a, b = Proxy(store, clock, "a"), Proxy(store, clock, "b")
    rid, first = await a.start("s1", 0)
    timings = Timings(prompt_n=40, predicted_n=8, prompt_ms=1.0, predicted_ms=1.0)
    a.router.complete(first, Completion(True, timings, "a reply"))
    a.shared.ended(a.router, rid, first, ("a reply", ()))
    for _ in range(3):  # the booking's release lands; the placement written after the answer does not yet
        await asyncio.sleep(0)
    assert (await store.read(None, URLS)).bookings == {url: [] for url in URLS}
    _, second = await b.start("s2", 0)  # a new session, routed by the other proxy
    assert _where(second) != _where(first), second.decision.reason  # s1's KV stays where s1's next turn goes
    _, again = await b.start("s1", 1)
    assert _where(again) == _where(first), again.decision.reason
    store.let_through.set()
    await a.shared.settled()


@pytest.mark.asyncio
async def test_a_dead_proxys_bookings_lapse() -> None:
    store_clock, clock = Clock(), Clock()
    store = MemoryStore(store_clock)
    a, b = Proxy(store, clock, "a"), Proxy(store, clock, "b")
    for n in range(4):
        await a.start(f"s{n}", 0)  # a dies with all four slots booked: it never ends nor renews them
    await b.shared.before_route(b.router, None)
    assert all(b.router.server_busy("plain", i) == 2 for i in (0, 1))
    store_clock.now += 15.0
    await b.shared.before_route(b.router, None)
    assert all(b.router.server_busy("plain", i) == 0 for i in (0, 1))


@pytest.mark.asyncio
async def test_an_outage_serves_on_said_once_and_sharing_resumes(caplog: pytest.LogCaptureFixture) -> None:
    store, clock = MemoryStore(Clock()), Clock()
    a, b = Proxy(store, clock, "a"), Proxy(store, clock, "b")
    rid, route = await a.start("s1", 0)
    await a.end(rid, route)
    store.down = True
    caplog.set_level(logging.WARNING, logger="adaptive_spec.shared_state.shell")
    live = []
    for n in range(3):
        live.append(await a.start(f"t{n}", 0))  # routed from a's own state, nothing raised
        clock.now += 2.0
    status = a.shared.status()
    assert status["reachable"] is False and status["weakened"] and status["down_s"] > 0
    assert sum("cannot be reached" in r.message for r in caplog.records) == 1
    store.down = False
    store.flush()  # a restart empties it
    await a.shared.before_route(a.router, "s1")
    await a.shared.settled()  # the bookings written again
    assert a.shared.status()["reachable"] is True
    assert sum("answers again" in r.message for r in caplog.records) == 1
    await b.shared.before_route(b.router, None)
    assert sum(b.router.server_busy("plain", i) for i in (0, 1)) == 3


def test_a_reply_served_through_another_proxy_joins_its_session() -> None:
    from adaptive_spec.sessions.grouping import echo_candidates, served_keys

    here, there = SessionRegistry(run="a"), SessionRegistry(run="b")
    first = {"messages": [{"role": "user", "content": "write me a function that adds two numbers together"}]}
    sid = there.assign({}, first).session_id
    reply = "def add(a, b):\n    return a + b"
    keys = served_keys(reply, ["call_1"])
    follow = {
        "messages": [*first["messages"], {"role": "assistant", "content": reply}, {"role": "user", "content": "thanks"}]
    }
    assert set(echo_candidates(follow)) <= set(keys) and echo_candidates(follow)
    assert here.assign({}, follow).source == "new"  # blind
    here.heard(dict.fromkeys(keys, sid))
    joined = here.assign({}, follow)
    assert (joined.session_id, joined.source) == (sid, "echo:reply")


@pytest.mark.asyncio
async def test_slots_another_proxy_erased_are_not_counted_on() -> None:
    """Read before routing (the news itself may come later): a placement written before its server's slots were
    emptied is out of its slot; one written after stands."""
    store, clock = MemoryStore(Clock()), Clock()
    a, b = Proxy(store, clock, "a"), Proxy(store, clock, "b")
    heard: list[tuple[str, bool]] = []
    b.shared.on_erased = lambda server, restarted: heard.append((server, restarted))
    rid, route = await a.start("s1", 0)
    await a.end(rid, route)
    server = a.router.server_url("plain", route.decision.replica)
    a.shared.erased(server, restarted=True)
    await a.shared.settled()
    await b.shared.before_route(b.router, "s1")
    placement = b.router.placements.get("s1")
    assert placement is not None and not placement.in_slot
    assert heard == [(server, False)]  # once: b's router and head store forget that server's slots
    await b.shared.before_route(b.router, "s1")
    assert heard == [(server, False)]
    rid, route = await a.start("s1", 1)  # served again there after the erasure: in its slot
    await a.end(rid, route)
    await b.shared.before_route(b.router, "s1")
    placement = b.router.placements.get("s1")
    assert placement is not None and placement.in_slot


@pytest.mark.asyncio
async def test_news_reaches_the_other_proxies_not_its_teller() -> None:
    store, clock = MemoryStore(Clock()), Clock()
    a, b = Proxy(store, clock, "a"), Proxy(store, clock, "b")
    entry = {"id": "00ff00ff00ff00ff00ff00ff"}
    a.shared.tell(HeadSaved("a", "00ff00ff00ff00ff00ff00ff", entry, "/heads/x.head", "t"))  # before b listens
    await a.shared.settled()
    got: dict[str, list[News]] = {"a": [], "b": []}
    erased: list[tuple[str, bool]] = []
    b.shared.on_erased = lambda server, restarted: erased.append((server, restarted))
    tasks = []
    for p in (a, b):

        async def heard(news: News, name: str = p.shared.proxy_id) -> None:
            got[name].append(news)

        tasks.append(asyncio.get_running_loop().create_task(p.shared.listening(heard)))
    await asyncio.sleep(0.01)
    a.shared.tell(HeadsGone("a", ("00ff00ff00ff00ff00ff00ff",)))
    a.shared.erased(URLS[0], restarted=True)
    await a.shared.settled()
    await asyncio.sleep(0.01)
    for task in tasks:
        task.cancel()
    assert [type(n) for n in got["b"]] == [HeadSaved, HeadsGone]  # the kept head first, then the news
    assert got["a"] == [] and erased == [(URLS[0], True)]


@pytest.mark.asyncio
async def test_a_booking_hands_its_forward_counts_to_the_head_store_and_an_outage_counts_later() -> None:
    store, clock = MemoryStore(Clock()), Clock()
    a, b = Proxy(store, clock, "a"), Proxy(store, clock, "b")
    rid, route = await a.start("s1", 0)
    server, slot = a.router.server_url("plain", route.decision.replica), route.slot
    mark = a.shared.counted(rid)
    assert mark is not None and a.shared.counted(rid) is None  # taken once
    assert mark.unchanged(await b.shared.forwards(server, slot), slot)
    await a.end(rid, route)
    await b.shared.forwarded(server)  # a request b forwards without a route (no booking): any slot's
    assert not mark.unchanged(await a.shared.forwards(server, slot), slot)
    # While the store is down, nothing is counted: no mark, no guard reading (the head store saves nothing); b's
    # forwards are counted on each server once the store answers again.
    counted = {url: await store_forwards(store, url) for url in URLS}
    store.down = True
    rid, route = await b.start("s2", 0)
    down_server = b.router.server_url("plain", route.decision.replica)
    assert b.shared.counted(rid) is None and await b.shared.forwards(down_server, None) is None
    assert "no head is saved" in " ".join(b.shared.status()["weakened"])
    store.down = False
    clock.now += 2.0
    await b.shared.before_route(b.router, None)
    await b.shared.settled()
    assert {url: await store_forwards(store, url) for url in URLS} == {
        url: n + (url == down_server) for url, n in counted.items()
    }


async def store_forwards(store: MemoryStore, server: str) -> int:
    counts = await store.forwards(server, None)
    return counts.forwards if counts is not None else 0


@pytest.mark.asyncio
async def test_one_proxy_warms_a_restarted_server_its_launcher_while_it_runs() -> None:
    store_clock = Clock()
    store, clock = MemoryStore(store_clock), Clock()
    a, b, c = (SharedState(store, lease_s=15.0, proxy_id=n, clock=clock) for n in "abc")
    server, launched = URLS
    assert await b.claim_warm(server) and not await a.claim_warm(server) and await b.claim_warm(server)
    store_clock.now += 61  # a later restart, found first by a
    assert await a.claim_warm(server) and not await b.claim_warm(server)
    a.launching([launched])
    await a.settled()
    for _ in range(2):  # each restart of the server it launched: a's alone, whoever finds it fresh first
        assert not await b.claim_warm(launched) and await a.claim_warm(launched)
        store_clock.now += 5  # within its record's lease (renewed while a runs)
    await a.close()  # a stops: its servers are anyone's to warm again
    assert await c.claim_warm(launched) and not await b.claim_warm(launched)
    store.down = True
    assert await b.claim_warm(server)  # an outage: each proxy warms alone, as without the shared state
