"""Where the shared state is kept: the interface the shell calls (`SharedStore`), and its in-process implementation
(`MemoryStore`: one process's proxies, as in the unit tests; expiry on an injected clock).

The Redis one is `redis_store.py`. Every method may raise `StoreDown`: the shell serves on from its own state
meanwhile."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Protocol

from adaptive_spec.errors import AdaptiveSpecError
from adaptive_spec.kv.heads.activity import Counted
from adaptive_spec.shared_state.news import HeadSaved, HeadsGone, News, SlotsErased, decode, encode
from adaptive_spec.shared_state.values import (
    UNNAMED_SLOT,
    Booked,
    Booking,
    Placed,
    Reading,
    SharedPlacement,
    counted,
)


class StoreDown(AdaptiveSpecError):
    """The shared state cannot be reached (stopped, restarted, a timeout)."""


class SharedStore(Protocol):
    label: str  # where it is, without a password: for the log and /adaptive/health

    async def sessions_of(self, keys: Sequence[str]) -> dict[str, str]:
        """The sessions that were served what these echo keys name (`sessions/grouping.echo_candidates`)."""
        ...

    async def served(self, keys: Sequence[str], session_id: str, ttl_s: float) -> None: ...

    async def read(self, session_id: str | None, servers: Sequence[str]) -> Reading:
        """The session's placement, and the live bookings and slot occupants of these servers: one round trip."""
        ...

    async def book(
        self, booking: Booking, lease_s: float, force: bool, placed: Placed | None = None, seen: str | None = None
    ) -> Booked:
        """Book the slot unless another proxy holds it (`force`: book it all the same). Atomic across proxies; booked,
        `placed` is written in the same step (as `place` writes it, for the booking's session). `seen`: the slot's
        occupant when the route was read ("" none; None: not read): another session placed there since refuses it
        too (unless forced). In the same round trip the request is counted on its server (`forwarded`), and the
        counts come back with it."""
        ...

    async def forwarded(self, server: str) -> None:
        """Count a request forwarded to the server that booked no slot (it may use any)."""
        ...

    async def forwards(self, server: str, slot: int | None) -> Counted | None:
        """The server's forward counts now (None: none kept, or none this version can read)."""
        ...

    async def renew(self, bookings: Sequence[Booking], lease_s: float) -> None:
        """Extend these bookings' leases (and write them again where the state was emptied meanwhile)."""
        ...

    async def release(self, booking: Booking) -> None: ...

    async def place(self, session_id: str, placement: SharedPlacement, slot: int | None, ttl_s: float) -> None:
        """The session's placement, and that its slot (on `placement.server`) now holds it."""
        ...

    async def tell(self, news: News, ttl_s: float) -> None:
        """Send the news to every proxy listening; a head saved, and when a server's slots were emptied, are kept
        `ttl_s` (a head removed is no longer kept)."""
        ...

    async def published(self) -> list[News]:
        """The heads kept (`tell`) that have not expired: what a proxy that starts listening has missed."""
        ...

    def listen(self) -> AsyncGenerator[News | None, None]:
        """The news as it is told, first None once listening (what was told before is then `published`)."""
        ...

    async def launched(self, servers: Sequence[str], proxy: str, lease_s: float) -> None:
        """`proxy` launched these servers and warm-starts them: recorded for `lease_s` (renewed while it runs)."""
        ...

    async def unlaunched(self, servers: Sequence[str], proxy: str) -> None:
        """`proxy` stops: its records of these servers go (those another proxy wrote since stay)."""
        ...

    async def claim_warm(self, server: str, proxy: str, window_s: float) -> bool:
        """Whether `proxy` warm-starts the server that it found fresh: its launcher's (recorded, `launched`) if
        it has one, else the first proxy's to claim it in `window_s` (a claim this proxy holds is taken again)."""
        ...

    async def close(self) -> None: ...


class MemoryStore:
    """The shared state in one process's memory, with the same expiry rules as Redis."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.label = "memory"
        self._clock = clock
        self._values: dict[str, tuple[object, float]] = {}  # key -> (value, expires at)
        self._bookings: dict[str, dict[str, float]] = {}  # server -> member -> lease end
        self._forwards: dict[str, dict[str, int | str]] = {}  # server -> its counts (as in Redis: `redis_store.py`)
        self._listeners: list[asyncio.Queue[bytes]] = []
        self.down = False  # a test's switch: every call raises StoreDown while it is set

    def _check(self) -> None:
        if self.down:
            raise StoreDown("memory store switched off")

    def _get(self, key: str) -> object | None:
        value = self._values.get(key)
        if value is None or value[1] <= self._clock():
            self._values.pop(key, None)
            return None
        return value[0]

    def _live(self, server: str) -> dict[str, float]:
        now = self._clock()
        held = self._bookings.setdefault(server, {})
        for member in [m for m, end in held.items() if end <= now]:
            del held[member]
        return held

    async def sessions_of(self, keys: Sequence[str]) -> dict[str, str]:
        self._check()
        return {k: v for k in keys if isinstance(v := self._get("echo:" + k), str)}

    async def served(self, keys: Sequence[str], session_id: str, ttl_s: float) -> None:
        self._check()
        for key in keys:
            self._values["echo:" + key] = (session_id, self._clock() + ttl_s)

    async def read(self, session_id: str | None, servers: Sequence[str]) -> Reading:
        self._check()
        raw = self._get("place:" + session_id) if session_id is not None else None
        bookings = {s: [b for m in self._live(s) if (b := Booking.parse(s, m)) is not None] for s in servers}
        occupants = {s: o for s in servers if isinstance(o := self._get("occupant:" + s), dict)}
        erased = {s: e for s in servers if isinstance(e := self._get("erased:" + s), int)}
        return Reading(SharedPlacement.decode(raw if isinstance(raw, bytes) else None), bookings, occupants, erased)

    async def book(
        self, booking: Booking, lease_s: float, force: bool, placed: Placed | None = None, seen: str | None = None
    ) -> Booked:
        self._check()
        held = self._live(booking.server)
        occupants = self._get("occupant:" + booking.server)
        now = occupants.get(max(booking.slot, 0), "") if isinstance(occupants, dict) else ""
        if not force and seen is not None and now not in (seen, booking.session):
            return Booked(False, self._count(booking))
        if not force:
            for member in held:
                other = Booking.parse(booking.server, member)
                if other is not None and other.blocks(booking):
                    return Booked(False, self._count(booking))
        held[booking.member] = self._clock() + lease_s
        if placed is not None:
            self._place(booking.session, placed.placement, placed.slot, placed.ttl_s)
        return Booked(True, self._count(booking))

    def _count(self, booking: Booking) -> Counted | None:
        """`redis_store._COUNT`: the request counted on its server; contested where another proxy's live booking could
        use its slot."""
        slot = None if booking.slot == UNNAMED_SLOT else booking.slot
        self._add(booking.server, "slot:" + str(booking.slot) if slot is not None else "unnamed")
        live = [b for m in self._live(booking.server) if (b := Booking.parse(booking.server, m)) is not None]
        contested = any(other.contests(booking) for other in live)
        return counted(self._read(booking.server, slot), slot, int(contested))

    def _add(self, server: str, field: str) -> None:
        counts = self._forwards.setdefault(server, {"epoch": secrets.token_hex(8)})
        for name in ("all", field):
            value = counts.get(name, 0)
            counts[name] = (value if isinstance(value, int) else 0) + 1

    def _read(self, server: str, slot: int | None) -> list[object]:
        counts = self._forwards.get(server, {})
        return [counts.get(k) for k in ("epoch", "all", "unnamed", "slot:" + str(slot if slot is not None else 0))]

    async def forwarded(self, server: str) -> None:
        self._check()
        self._add(server, "unnamed")

    async def forwards(self, server: str, slot: int | None) -> Counted | None:
        self._check()
        return counted(self._read(server, slot), slot)

    async def renew(self, bookings: Sequence[Booking], lease_s: float) -> None:
        self._check()
        for booking in bookings:
            self._live(booking.server)[booking.member] = self._clock() + lease_s

    async def release(self, booking: Booking) -> None:
        self._check()
        self._live(booking.server).pop(booking.member, None)

    async def place(self, session_id: str, placement: SharedPlacement, slot: int | None, ttl_s: float) -> None:
        self._check()
        self._place(session_id, placement, slot, ttl_s)

    def _place(self, session_id: str, placement: SharedPlacement, slot: int | None, ttl_s: float) -> None:
        end = self._clock() + ttl_s
        self._values["place:" + session_id] = (placement.encode(), end)
        if slot is not None:
            occupants = self._get("occupant:" + placement.server)
            table = dict(occupants) if isinstance(occupants, dict) else {}
            table[slot] = session_id
            self._values["occupant:" + placement.server] = (table, end)

    async def tell(self, news: News, ttl_s: float) -> None:
        self._check()
        end = self._clock() + ttl_s
        if isinstance(news, HeadSaved):
            self._values["head:" + news.head] = (encode(news), end)
        elif isinstance(news, HeadsGone):
            for head in news.heads:
                self._values.pop("head:" + head, None)
        elif isinstance(news, SlotsErased):
            self._values["erased:" + news.server] = (news.stamp_ns, end)
        for queue in self._listeners:
            queue.put_nowait(encode(news))

    async def published(self) -> list[News]:
        self._check()
        kept = [self._get(k) for k in list(self._values) if k.startswith("head:")]
        return [n for raw in kept if isinstance(raw, bytes) and (n := decode(raw)) is not None]

    async def listen(self) -> AsyncGenerator[News | None, None]:
        self._check()
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        self._listeners.append(queue)
        try:
            yield None
            while True:
                news = decode(await queue.get())
                if news is not None:
                    yield news
        finally:
            self._listeners.remove(queue)

    async def launched(self, servers: Sequence[str], proxy: str, lease_s: float) -> None:
        self._check()
        for server in servers:
            self._values["launched:" + server] = (proxy, self._clock() + lease_s)

    async def unlaunched(self, servers: Sequence[str], proxy: str) -> None:
        self._check()
        for server in servers:
            if self._get("launched:" + server) == proxy:
                self._values.pop("launched:" + server)

    async def claim_warm(self, server: str, proxy: str, window_s: float) -> bool:
        self._check()
        launcher = self._get("launched:" + server)
        if launcher is not None:
            return launcher == proxy
        if self._get("warm:" + server) not in (None, proxy):
            return False
        self._values["warm:" + server] = (proxy, self._clock() + window_s)
        return True

    def flush(self) -> None:
        """Everything forgotten at once (Redis's FLUSHALL)."""
        self._values.clear()
        self._bookings.clear()
        self._forwards.clear()

    async def close(self) -> None:
        return None
