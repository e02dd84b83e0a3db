"""The request path's side of the shared state: the reads before grouping and routing, the booking after `route()`,
the writes after `complete()` (off the request path), the lease renewal, and what an outage weakens.

While the store cannot be reached the proxy serves from its own state: said once in the log and in
/adaptive/health, tried again at most once a second, and sharing resumes (its live bookings written again) when the
store answers."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from adaptive_spec.common.lru import LRU
from adaptive_spec.kv.heads.activity import Counted
from adaptive_spec.routing.contract import Route
from adaptive_spec.routing.placements import Placement
from adaptive_spec.routing.router import Router
from adaptive_spec.sessions.grouping import echo_candidates, served_keys
from adaptive_spec.shared_state.news import News, SlotsErased
from adaptive_spec.shared_state.store import SharedStore, StoreDown
from adaptive_spec.shared_state.values import UNNAMED_SLOT, Booked, Booking, Placed, Reading, SharedPlacement

log = logging.getLogger(__name__)
T = TypeVar("T")
RETRY_S = 1.0
# Tries to route and book a request (the last books all the same). A refusal means another proxy's booking landed
# between this one's read and its booking: as many new sessions arriving at once at as many proxies take as many.
BOOKING_TRIES = 5
RECALL_AGAIN_S = 0.02  # while the store is down, one call a second tries it again; the others skip it
# How long a proxy's claim to warm-start a server it found fresh keeps the others from doing it too: longer than the
# proxies take to find one restart (a health poll and a watch, seconds), short enough that a later restart found
# first by another proxy is warmed again. A server with a launcher is warmed by its launcher, every restart.
WARM_CLAIM_S = 60.0
# What this proxy does without the store, said in the log and in /adaptive/health.
WEAKENED = (
    "slot bookings count this proxy's requests only",
    "sessions and placements are this proxy's own: a turn another proxy served is a new session here",
    "no head is saved: its guards cannot count the other proxies' requests to the slot",
    "a restarted server may be warm-started by every proxy that finds it fresh",
)
_UNCOUNTED = Booked(True)  # a booking the store could not take: booked here alone, counted nowhere


class SharedState:
    def __init__(
        self,
        store: SharedStore,
        lease_s: float = 15.0,
        ttl_s: float = 3600.0,
        proxy_id: str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`lease_s`: how long a booking outlives its proxy (renewed every third of it while its request runs);
        `ttl_s`: how long sessions' echoes and placements are kept after their last turn."""
        self.store, self.lease_s, self.ttl_s = store, lease_s, ttl_s
        self.proxy_id = proxy_id or secrets.token_hex(6)
        self._clock = clock
        self._live: dict[str, Booking] = {}  # request id -> its booking
        self._stamps: LRU[str, int] = LRU(65_536)  # session -> the stamp of the placement this proxy holds
        self._down_since: float | None = None
        self._down_reason = ""
        self._retry_at = 0.0
        self._writes: set[asyncio.Task[None]] = set()
        self._erasures: dict[str, int] = {}  # server -> when its slots were last emptied, as this proxy knows (ns)
        self._launched: tuple[str, ...] = ()  # the servers this proxy launched and warm-starts (`launching`)
        # Told when another proxy emptied a server's slots (its URL; whether it restarted): the proxy's router and
        # head store forget what they knew there.
        self.on_erased: Callable[[str, bool], None] = lambda _server, _restarted: None
        self.conflicts = 0  # bookings refused because another proxy held the slot (the request routed again)
        # The shared forward counts each request's booking returned, until the head store takes them (`counted`).
        self._counted: LRU[str, Counted] = LRU(4096)
        # Servers this proxy forwarded to while the store was down: counted once it answers again (`_recount`).
        self._uncounted: set[str] = set()

    # --- the outage ---------------------------------------------------------------------------------------------

    async def _call(self, work: Callable[[], Coroutine[Any, Any, T]], default: T) -> T:
        if self._down_since is not None and self._clock() < self._retry_at:
            return default
        try:
            result = await work()
        except StoreDown as exc:
            if self._down_since is None:
                self._down_since, self._down_reason = self._clock(), str(exc)
                log.warning(
                    "shared state: %s cannot be reached (%s); serving from this proxy's own state meanwhile: %s",
                    self.store.label,
                    exc,
                    "; ".join(WEAKENED),
                )
            self._retry_at = self._clock() + RETRY_S
            return default
        self._answered()
        return result

    def _answered(self) -> None:
        """The store answered (a call, or the listener connecting again): after an outage, sharing resumes."""
        if self._down_since is None:
            return
        log.warning("shared state: %s answers again; sharing resumes", self.store.label)
        self._down_since = None
        self._spawn(self._renew_all())  # its bookings, lost with a restart or a flush, written again
        self._spawn(self._recount())

    def status(self) -> dict[str, Any]:
        """For /adaptive/health."""
        up = self._down_since is None
        out: dict[str, Any] = {"store": self.store.label, "reachable": up, "proxy": self.proxy_id}
        out["bookings"], out["conflicts"] = len(self._live), self.conflicts
        if not up:
            out["down_s"] = round(self._clock() - (self._down_since or 0.0), 1)
            out["error"], out["weakened"] = self._down_reason, list(WEAKENED)
        return out

    # --- before grouping and routing ---------------------------------------------------------------------------

    async def recall(self, body: Mapping[str, Any]) -> dict[str, str]:
        """The sessions other proxies served the request's newest replies and tool calls to (for
        `SessionRegistry.heard`)."""
        keys = echo_candidates(body)
        if not keys:
            return {}
        none: dict[str, str] = {}
        found = await self._call(lambda: self.store.sessions_of(keys), none)
        if not found and self._down_since is None:
            # A follow-up whose answer another proxy ended a moment ago: that proxy writes what it served once the
            # answer is out, and the client may be quicker. Asked once more after a moment (a new conversation
            # rarely carries assistant messages, so this is seldom paid).
            await asyncio.sleep(RECALL_AGAIN_S)
            found = await self._call(lambda: self.store.sessions_of(keys), none)
        return found

    async def before_route(self, router: Router, session_id: str | None) -> Reading | None:
        """Read the session's placement and the servers' bookings, and hand what other proxies did to the router.
        What was read (None: nothing, the store is down) goes to `book`."""
        servers = _servers(router)
        reading = await self._call(lambda: self.store.read(session_id, servers), None)
        if reading is None:
            router.adopt(None, None, {})  # what the store said before is stale: this proxy's own counts alone
            return None
        for server, stamp in reading.erased.items():  # emptied since this proxy last knew (its news not heard yet)
            if self._erased_seen(server, stamp):
                self.on_erased(server, False)
        booked = reading.booked_elsewhere(self.proxy_id, session_id)
        router.adopt(session_id, self._placement(router, session_id, reading), booked, reading.occupants)
        return reading

    def _placement(self, router: Router, session_id: str | None, reading: Reading) -> Placement | None:
        """The placement the router takes: the other proxy's when it is newer than this one's and names the same
        server here, else this proxy's own; out of its slot where that slot has served another session since."""
        if session_id is None:
            return None
        shared, known = reading.placement, self._stamps.get(session_id)
        placement = router.placements.get(session_id)
        if shared is not None and (known is None or shared.stamp_ns > known):
            p = shared.placement
            if router.server_url(p.profile, p.replica) == shared.server:
                placement = p
                self._stamps.put(session_id, shared.stamp_ns)
        if placement is None:
            return None
        server = router.server_url(placement.profile, placement.replica)
        occupant = reading.occupants.get(server, {}).get(placement.slot if placement.slot is not None else 0)
        # Written before its server's slots were emptied (erased through another proxy, or restarted): gone.
        gone = (self._stamps.get(session_id) or 0) < reading.erased.get(server, 0)
        return replace(placement, in_slot=placement.in_slot and occupant in (None, session_id) and not gone)

    # --- the booking, after route() -----------------------------------------------------------------------------

    async def book(
        self, router: Router, route: Route, request_id: str, force: bool, seen: Reading | None = None
    ) -> bool:
        """Book the route's slot for this request (any booking it held before goes: a failover routes again), its
        session placed there in the same step. False: another proxy booked that slot since it was read: complete the
        route and route again (`force`: book it all the same; see `must_book`). Refused too where the slot holds
        another session than `seen` (the reading the route was made from) said: placed there since."""
        self._drop(request_id)
        profile, replica = route.decision.profile, route.decision.replica
        slot = route.slot if route.slot is not None else (0 if router.slot_count(profile, replica) == 1 else None)
        where = router.server_url(profile, replica)
        session = "" if route.session_id is None or route.decision.side else route.session_id
        booking = Booking(where, UNNAMED_SLOT if slot is None else slot, self.proxy_id, request_id, session)
        placed = self._placed(router, route) if session else None
        occupant = None if seen is None or slot is None else seen.occupants.get(where, {}).get(slot, "")
        booked = await self._call(lambda: self.store.book(booking, self.lease_s, force, placed, occupant), _UNCOUNTED)
        if not booked.ok:
            self.conflicts += 1
            return False
        self._live[request_id] = booking
        self._note_count(request_id, where, booked.counted)
        if placed is not None:
            self._stamps.put(session, placed.placement.stamp_ns)
        return True

    def _placed(self, router: Router, route: Route) -> Placed:
        """Where the session's KV will be, written with its booking, before the turn is forwarded: a proxy that reads
        after the booking sees its slot taken (even once the turn has ended, before the placement learned from the
        answer is written), and its next turn may reach another proxy the moment its answer ends."""
        assert route.session_id is not None
        profile, replica = route.decision.profile, route.decision.replica
        old = router.placements.get(route.session_id)
        placement = (
            Placement(profile, route.slot, old.cached_tokens if old is not None else 0, 1, 0.0, replica=replica)
            if old is None
            else replace(old, profile=profile, slot=route.slot, replica=replica, in_slot=True, overwritten=False)
        )
        shared = SharedPlacement(router.server_url(profile, replica), placement, time.time_ns())
        return Placed(shared, placement.slot if placement.slot is not None else 0, self.ttl_s)

    # --- the forward counts (the head store's guards: kv/heads/activity.Counted) ----------------------------------

    def _note_count(self, request_id: str, server: str, counts: Counted | None) -> None:
        if counts is None:
            self._counted.pop(request_id)
            self._uncounted.add(server)
        else:
            self._counted.put(request_id, counts)

    def counted(self, request_id: str) -> Counted | None:
        """The forward counts the request's booking returned (taken once; None: not booked, or not counted)."""
        return self._counted.pop(request_id)

    async def forwarded(self, server: str) -> None:
        """A request that books no slot (not routed), counted on its server before it is forwarded: it may use any
        slot there. One round trip; an outage leaves it uncounted (and counted once the store answers again)."""
        if not await self._call(lambda: self._count_one(server), False):
            self._uncounted.add(server)

    async def forwards(self, server: str, slot: int | None) -> Counted | None:
        """The server's forward counts now (None: the store cannot be reached, or holds nothing readable)."""
        return await self._call(lambda: self.store.forwards(server, slot), None)

    async def _recount(self) -> None:
        """Requests this proxy forwarded while the store was down, counted once it is back (one on each such server):
        a save another proxy runs from now on does not take a slot one of them may have used."""
        servers, self._uncounted = self._uncounted, set()
        for server in sorted(servers):
            if not await self._call(lambda s=server: self._count_one(s), False):  # type: ignore[misc]
                self._uncounted.add(server)

    async def _count_one(self, server: str) -> bool:
        await self.store.forwarded(server)
        return True

    def _drop(self, request_id: str) -> None:
        booking = self._live.pop(request_id, None)
        if booking is not None:
            self._spawn(self._call(lambda: self.store.release(booking), None))

    # --- after complete() ---------------------------------------------------------------------------------------

    def ended(
        self, router: Router, request_id: str, route: Route | None, served: tuple[str, Sequence[str]] | None
    ) -> None:
        """The request ended (the router completed its route): its booking goes; served in full, its session's
        placement and what it was served are written for the other proxies. Off the request path."""
        self._drop(request_id)
        if route is None or served is None or route.session_id is None or route.decision.side:
            return
        self._write(route.session_id, router, router.placements.get(route.session_id), served_keys(*served))

    def _write(
        self, session_id: str, router: Router, placement: Placement | None, keys: Sequence[str]
    ) -> asyncio.Task[None] | None:
        """The session's placement and what it was served, written for the other proxies, off the request path."""
        if placement is None and not keys:
            return None
        stamp = time.time_ns()
        self._stamps.put(session_id, stamp)

        async def write() -> None:
            if keys:
                await self.store.served(keys, session_id, self.ttl_s)
            if placement is not None:
                url = router.server_url(placement.profile, placement.replica)
                slot = placement.slot if placement.slot is not None else 0
                await self.store.place(session_id, SharedPlacement(url, placement, stamp), slot, self.ttl_s)

        return self._spawn(self._call(write, None))

    # --- news -----------------------------------------------------------------------------------------------------

    def tell(self, news: News) -> None:
        """Tell the other proxies (off the request path; an outage loses it: they learn it when it happens again)."""
        self._spawn(self._call(lambda: self.store.tell(news, self.ttl_s), None))

    def erased(self, server: str, restarted: bool) -> None:
        """This proxy saw the server's slots emptied (it erased them, or the server restarted): the others' routers
        must not count on the KV their placements name there."""
        stamp = time.time_ns()
        self._erased_seen(server, stamp)
        self.tell(SlotsErased(self.proxy_id, server, restarted, stamp))

    def _erased_seen(self, server: str, stamp: int) -> bool:
        """Whether this is news: a newer emptying of the server than this proxy knew of."""
        if stamp <= self._erasures.get(server, 0):
            return False
        self._erasures[server] = stamp
        return True

    async def listening(self, heard: Callable[[News], Awaitable[None]]) -> None:
        """Run for the proxy's life: hand what the other proxies tell of heads to `heard` (the heads kept first, on
        each (re)connection: what was told meanwhile was missed), and their servers emptied to `on_erased`. A store
        that cannot be reached is tried again a second later."""
        while True:
            try:
                async for news in self.store.listen():
                    if news is None:
                        published = await self.store.published()
                        self._answered()  # an idle proxy finds the store back here, not at its next request
                        for kept in published:
                            if kept.proxy != self.proxy_id:
                                await heard(kept)
                    elif isinstance(news, SlotsErased):
                        if news.proxy != self.proxy_id and self._erased_seen(news.server, news.stamp_ns):
                            self.on_erased(news.server, news.restarted)
                    elif news.proxy != self.proxy_id:
                        await heard(news)
            except StoreDown as exc:
                log.debug("shared state: not listening for news (%s); again in %.0f s", exc, RETRY_S)
            await asyncio.sleep(RETRY_S)

    # --- restarts: who warms a server -----------------------------------------------------------------------------

    def launching(self, servers: Sequence[str]) -> None:
        """This proxy launched these servers and warm-starts them: recorded for the others (renewed with the
        bookings), so that it alone warms them after each restart."""
        self._launched = tuple(servers)
        self._spawn(self._call(lambda: self.store.launched(self._launched, self.proxy_id, self.lease_s), None))

    async def claim_warm(self, server: str) -> bool:
        """Whether this proxy warm-starts the server it found fresh (`SharedStore.claim_warm`); the store down: it
        does, as any proxy alone would."""
        return await self._call(lambda: self.store.claim_warm(server, self.proxy_id, WARM_CLAIM_S), True)

    # --- background ---------------------------------------------------------------------------------------------

    def _spawn(self, work: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(work)
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
        return task

    async def _renew_all(self) -> None:
        live = list(self._live.values())
        if live:
            await self._call(lambda: self.store.renew(live, self.lease_s), None)
        if self._launched:
            await self._call(lambda: self.store.launched(self._launched, self.proxy_id, self.lease_s), None)

    async def renewing(self) -> None:
        """Run for the proxy's life: renew the live bookings (and the launcher records) every third of a lease."""
        while True:
            await asyncio.sleep(self.lease_s / 3)
            await self._renew_all()

    async def settled(self) -> None:
        """The writes under way have ended (at shutdown; in tests, before reading what they wrote)."""
        while self._writes:
            await asyncio.wait(list(self._writes), timeout=2.0)

    async def close(self) -> None:
        """At shutdown: the writes under way end, this proxy's bookings and launcher records go, the connection
        closes."""
        for request_id in list(self._live):
            self._drop(request_id)
        if self._launched:  # the others warm those servers from now on (a restart of this proxy launches new ones)
            self._spawn(self._call(lambda: self.store.unlaunched(self._launched, self.proxy_id), None))
        if self._writes:
            await asyncio.wait(list(self._writes), timeout=2.0)  # bounded: a store that hangs does not hold the stop
        await self.store.close()


def _servers(router: Router) -> list[str]:
    return sorted(
        {router.server_url(n, i) for n in router.health.names() for i in range(len(router.health.replica_health(n)))}
    )


def must_book(router: Router, route: Route, attempt: int) -> bool:
    """Whether the try `attempt` (from 0) books its slot all the same: the last try, or a route that, read again
    after a refusal, still waits for a slot known taken (every slot is: it queues there, as with one proxy). The
    first try's reading may be stale (a booking since released): it is routed again rather than forced."""
    return attempt == BOOKING_TRIES - 1 or (attempt > 0 and router.waits(route))
