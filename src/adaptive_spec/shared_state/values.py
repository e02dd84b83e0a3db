"""The values proxies share: a booking of a slot, a session's placement as another proxy reads it, and what one read
before routing brings back.

Pure: encoded and decoded here, stored by `store.py`'s implementations."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson

from adaptive_spec.kv.heads.activity import Counted
from adaptive_spec.routing.placements import Placement

UNNAMED_SLOT = -1  # a request that named no slot on a server of several


@dataclass(frozen=True, slots=True)
class Booking:
    """One request's hold on a slot of a server, by the proxy that routed it there, until it ends or its lease
    lapses (the proxy stopped renewing it: it died)."""

    server: str  # the server's base URL: every proxy names it so
    slot: int  # UNNAMED_SLOT where the request named none
    proxy: str
    request: str
    # The session it serves ("" for none): its own earlier turn's booking, not yet released by the proxy that
    # served it when this turn arrives elsewhere, does not keep it out of its slot.
    session: str = ""

    @property
    def member(self) -> str:
        return f"{self.slot}|{self.proxy}|{self.request}|{self.session}"

    @staticmethod
    def parse(server: str, member: str) -> Booking | None:
        parts = member.split("|", 3)
        if len(parts) != 4 or not parts[1] or not parts[2]:
            return None
        try:
            return Booking(server, int(parts[0]), parts[1], parts[2], parts[3])
        except ValueError:
            return None

    def blocks(self, other: Booking) -> bool:
        """Whether this booking keeps `other` out of its slot: another proxy's, in that slot, for another session
        (a proxy's own bookings are its router's to count)."""
        return (
            self.slot == other.slot
            and self.slot >= 0
            and self.proxy != other.proxy
            and not (self.session and self.session == other.session)
        )

    def contests(self, other: Booking) -> bool:
        """Whether this booking's request could still use `other`'s slot (one of them named none, or both the same),
        being another proxy's, for another session: while it is live, `other`'s counts cannot tell what that slot
        will hold (its request may reach the server after `other`'s)."""
        same = UNNAMED_SLOT in (self.slot, other.slot) or self.slot == other.slot
        return same and self.proxy != other.proxy and not (self.session and self.session == other.session)


@dataclass(frozen=True, slots=True)
class Booked:
    """A booking's answer: whether the slot was booked, and the server's forward counts with this request counted, in
    the same round trip (`kv/heads/activity.Counted`: the head store's guards compare them; None: not counted)."""

    ok: bool
    counted: Counted | None = None


_EPOCH_MAX = 64


def counted(raw: Sequence[object], slot: int | None, contested: object = 0) -> Counted | None:
    """The counts as the store holds them (epoch, all, unnamed, the slot's; bytes or ints), checked: None for any
    value that is not what this version writes (a count no guard can trust)."""
    if len(raw) != 4:
        return None
    epoch, *numbers = raw
    if isinstance(epoch, bytes):
        epoch = epoch.decode("ascii", "replace")
    if not isinstance(epoch, str) or not 0 < len(epoch) <= _EPOCH_MAX:
        return None
    ints = [_count(n) for n in numbers]
    if None in ints or not isinstance(contested, int):
        return None
    forwards, unnamed, in_slot = (n or 0 for n in ints)
    return Counted(epoch, forwards, unnamed, slot, in_slot, contested=bool(contested))


def _count(raw: object) -> int | None:
    """A counter: an int, or the digits Redis keeps (absent: none counted yet)."""
    if raw is None:
        return 0
    if isinstance(raw, bytes) and raw.isdigit() and len(raw) <= 19:
        return int(raw)
    return raw if isinstance(raw, int) and not isinstance(raw, bool) and raw >= 0 else None


@dataclass(frozen=True, slots=True)
class SharedPlacement:
    """A session's placement as the proxy that served its last turn wrote it: on which server (by URL, checked
    against the reader's own profile and replica there) and when (`stamp_ns`: a newer one stands)."""

    server: str
    placement: Placement
    stamp_ns: int

    def encode(self) -> bytes:
        return orjson.dumps({"server": self.server, "stamp_ns": self.stamp_ns, "placement": asdict(self.placement)})

    @staticmethod
    def decode(raw: bytes | str | None) -> SharedPlacement | None:
        """None for nothing, or for what does not read as a placement (another version wrote it)."""
        if raw is None:
            return None
        try:
            data: Any = orjson.loads(raw)
            return SharedPlacement(str(data["server"]), Placement(**data["placement"]), int(data["stamp_ns"]))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True, slots=True)
class Placed:
    """A session's placement written by its booking, in the same atomic step (`SharedStore.book`): a proxy that reads
    after the booking finds the slot's occupant (`slot`; None: the request named none) and the session's placement
    there, even once the booking itself has ended. The session is the booking's."""

    placement: SharedPlacement
    slot: int | None
    ttl_s: float


@dataclass(frozen=True, slots=True)
class Reading:
    """What one read before routing found: the session's placement, the live bookings of each server, and which
    session each slot served last (`occupants`: a placement whose slot has served another session since is no longer
    in the slot), and when each server's slots were last seen emptied (`erased`, ns: a placement written before
    holds nothing there)."""

    placement: SharedPlacement | None = None
    bookings: dict[str, list[Booking]] = field(default_factory=dict)
    occupants: dict[str, dict[int, str]] = field(default_factory=dict)
    erased: dict[str, int] = field(default_factory=dict)

    def booked_elsewhere(self, proxy: str, session: str | None = None) -> dict[str, dict[int, int]]:
        """The requests proxies other than `proxy` booked, per server and slot (`session`'s own aside)."""
        out: dict[str, dict[int, int]] = {}
        for server, bookings in self.bookings.items():
            for b in bookings:
                if b.proxy != proxy and not (session and b.session == session):
                    slots = out.setdefault(server, {})
                    slots[b.slot] = slots.get(b.slot, 0) + 1
        return out
