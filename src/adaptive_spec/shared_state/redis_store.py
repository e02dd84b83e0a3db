"""The shared state in Redis (`serve --shared-state redis://HOST:PORT/DB`; a password and TLS as Redis URLs carry
them: `redis://:PASSWORD@HOST/0`, `rediss://…`).

Every key has an expiry; bookings are the members of one sorted set
per server, scored by the end of their lease in Redis's own clock, so proxies on hosts whose clocks differ agree."""

from __future__ import annotations

import secrets
from collections.abc import AsyncGenerator, Sequence
from typing import Any
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from adaptive_spec.kv.heads.activity import Counted
from adaptive_spec.shared_state.news import HeadSaved, HeadsGone, News, SlotsErased, decode, encode
from adaptive_spec.shared_state.store import StoreDown
from adaptive_spec.shared_state.values import (
    UNNAMED_SLOT,
    Booked,
    Booking,
    Placed,
    Reading,
    SharedPlacement,
    counted,
)

PREFIX = "adaptive-spec:"
NEWS = PREFIX + "news"  # the pub/sub channel of `tell`
_HEADS = PREFIX + "heads"  # the ids of the heads kept (`head:<id>`), for a proxy that starts listening
_PUBLISHED_MAX = 1024  # the most heads a proxy that starts listening reads back
_TIMEOUT_S = 0.5  # a proxy waits this long at most before serving on without the shared state

# Each script reads the time from Redis itself. A lease is a booking's score: the moment (ms) it lapses.
_NOW = "local t = redis.call('TIME') local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) "
_LIVE = (
    _NOW
    + """
local out = {}
for i, key in ipairs(KEYS) do
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  out[i] = redis.call('ZRANGE', key, 0, -1)
end
return out
"""
)
# The booking's session placed with it (values.Placed), as `place` writes it: KEYS[2] its placement, KEYS[3] the
# server's occupants; ARGV[7] the placement ('' for none), ARGV[8] the slot it occupies ('' for none), ARGV[9] ttl ms.
_PLACED = """
if ARGV[7] ~= '' then
  redis.call('SET', KEYS[2], ARGV[7], 'PX', tonumber(ARGV[9]))
  if ARGV[8] ~= '' then
    redis.call('HSET', KEYS[3], ARGV[8], ARGV[4])
    redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[9]))
  end
end
"""
# The slot's occupant as the route read it (ARGV[10]: '*' not read, '' none, else a session; the slot ARGV[11]):
# another session placed there since refuses the booking, unforced: its route was made before and is made again.
_SEEN = """
if ARGV[6] == '0' and ARGV[10] ~= '*' then
  local held = redis.call('HGET', KEYS[3], ARGV[11]) or ''
  if held ~= ARGV[10] and held ~= ARGV[4] then return 0 end
end
"""
# KEYS[1]: the server's bookings; ARGV: member, slot, proxy, session, lease ms, force. Refused: a live booking of
# another proxy in that slot, for another session (values.Booking.blocks). Booked, the session is placed in the same
# step (`_PLACED`): no proxy reads the booking without the placement, nor, once it ends, the slot without its occupant.
_BOOK = (
    _NOW
    + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
"""
    + _SEEN
    + """
if ARGV[6] == '0' and tonumber(ARGV[2]) >= 0 then
  for _, m in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
    local _, _, slot, proxy, _, session = string.find(m, '^([^|]*)|([^|]*)|([^|]*)|(.*)$')
    if slot == ARGV[2] and proxy ~= ARGV[3] and not (session ~= '' and session == ARGV[4]) then return 0 end
  end
end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[5]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[5]))
"""
    + _PLACED
    + "return 1\n"
)
# The forward counts of a server (`forwards:<server>`, a hash: `epoch`, `all`, `unnamed`, `slot:<n>`), kept a day
# after the last count: the head store's guards (kv/heads/activity.Counted) compare them. KEYS[1]: the counts,
# KEYS[2]: the server's bookings; ARGV: slot, proxy, session, a new epoch (kept only where none is), expiry ms.
# Returns the epoch, all, unnamed, the slot's count, and whether another proxy's live booking could use that slot
# (values.Booking.contests). Run in the booking's own round trip, after it.
_COUNTS_TTL_MS = 24 * 3600 * 1000
_COUNT = (
    _NOW
    + """
redis.call('HSETNX', KEYS[1], 'epoch', ARGV[4])
local all = redis.call('HINCRBY', KEYS[1], 'all', 1)
local field = 'slot:' .. ARGV[1]
if ARGV[1] == '-1' then field = 'unnamed' end
local here = redis.call('HINCRBY', KEYS[1], field, 1)
redis.call('PEXPIRE', KEYS[1], ARGV[5])
local contested = 0
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '(' .. now, '+inf')) do
  local _, _, slot, proxy, _, session = string.find(m, '^([^|]*)|([^|]*)|([^|]*)|(.*)$')
  if proxy and proxy ~= ARGV[2] and (slot == ARGV[1] or slot == '-1' or ARGV[1] == '-1')
     and not (session ~= '' and session == ARGV[3]) then contested = 1 end
end
return {redis.call('HGET', KEYS[1], 'epoch'), all, redis.call('HGET', KEYS[1], 'unnamed') or 0, here, contested}
"""
)
# KEYS[1]: the server's bookings; ARGV[1]: lease ms, then the members.
_RENEW = (
    _NOW
    + """
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[i]) end
redis.call('PEXPIRE', KEYS[1], 2 * tonumber(ARGV[1]))
return 1
"""
)

# KEYS[1]: the server's launcher record, KEYS[2]: its warm-start claim; ARGV: proxy, window ms. A launched server is
# warmed by its launcher alone; another, by the first proxy to claim it (again by that proxy within the window).
_CLAIM_WARM = """
local launcher = redis.call('GET', KEYS[1])
if launcher then
  if launcher == ARGV[1] then return 1 end
  return 0
end
local held = redis.call('GET', KEYS[2])
if held and held ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[1], 'PX', tonumber(ARGV[2]))
return 1
"""
# KEYS: launcher records; ARGV[1]: the proxy whose records go.
_UNLAUNCH = """
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then redis.call('DEL', key) end
end
return 1
"""


def _count(pipe: Any, booking: Booking) -> None:
    """The booking's request counted on its server (`_COUNT`), in the booking's pipeline."""
    keys = [PREFIX + "forwards:" + booking.server, PREFIX + "booked:" + booking.server]
    pipe.eval(_COUNT, 2, *keys, str(booking.slot), booking.proxy, booking.session, secrets.token_hex(8), _COUNTS_TTL_MS)


def _placed_args(placed: Placed | None) -> list[str | int]:
    """ARGV[7:10] of the booking: the placement, the slot it occupies and the ttl, or nothing to place."""
    if placed is None:
        return ["", "", 0]
    slot = "" if placed.slot is None else str(placed.slot)
    return [placed.placement.encode().decode(), slot, max(1, int(placed.ttl_s * 1000))]


def redacted(url: str) -> str:
    """The URL without its password, for the log and /adaptive/health."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return f"{parts.scheme}://{netloc}{parts.path}"


class RedisStore:
    def __init__(self, url: str, client: Any = None) -> None:
        """`client`: a `redis.asyncio.Redis` to use instead of one made from `url`."""
        self.label, self._url = redacted(url), url
        self._redis: Any = client or aioredis.from_url(
            url, socket_timeout=_TIMEOUT_S, socket_connect_timeout=_TIMEOUT_S, retry_on_timeout=False
        )

    async def _run(self, work: Any) -> Any:
        try:
            return await work
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreDown(f"{self.label}: {exc}") from exc

    async def sessions_of(self, keys: Sequence[str]) -> dict[str, str]:
        if not keys:
            return {}
        found = await self._run(self._redis.mget([PREFIX + "echo:" + k for k in keys]))
        return {k: v.decode() for k, v in zip(keys, found, strict=True) if v is not None}

    async def served(self, keys: Sequence[str], session_id: str, ttl_s: float) -> None:
        if not keys:
            return
        pipe = self._redis.pipeline(transaction=False)
        for key in keys:
            pipe.set(PREFIX + "echo:" + key, session_id, px=int(ttl_s * 1000))
        await self._run(pipe.execute())

    async def read(self, session_id: str | None, servers: Sequence[str]) -> Reading:
        pipe = self._redis.pipeline(transaction=False)
        pipe.get(PREFIX + "place:" + (session_id or ""))
        # EVAL, not EVALSHA: a restarted Redis has no scripts cached, and each is a few hundred bytes.
        pipe.eval(_LIVE, len(servers), *[PREFIX + "booked:" + s for s in servers])
        pipe.mget([PREFIX + "erased:" + s for s in servers] or [PREFIX + "erased:"])
        for server in servers:
            pipe.hgetall(PREFIX + "occupant:" + server)
        placed, live, erased, *occupants = await self._run(pipe.execute())
        bookings = {
            s: [b for m in members if (b := Booking.parse(s, m.decode())) is not None]
            for s, members in zip(servers, live, strict=True)
        }
        occupied = {
            s: {int(k): v.decode() for k, v in table.items() if k.lstrip(b"-").isdigit()}
            for s, table in zip(servers, occupants, strict=True)
            if table
        }
        stamps = {s: int(e) for s, e in zip(servers, erased, strict=False) if e is not None and e.isdigit()}
        placement = SharedPlacement.decode(placed) if session_id is not None else None
        return Reading(placement, bookings, occupied, stamps)

    async def book(
        self, booking: Booking, lease_s: float, force: bool, placed: Placed | None = None, seen: str | None = None
    ) -> Booked:
        args: list[str | int] = [booking.member, str(booking.slot), booking.proxy, booking.session]
        args += [int(lease_s * 1000), "1" if force else "0"]
        args += _placed_args(placed)
        args += ["*" if seen is None else seen, str(max(booking.slot, 0))]
        keys = [PREFIX + "booked:" + booking.server]
        keys += [PREFIX + "place:" + booking.session, PREFIX + "occupant:" + booking.server]
        pipe = self._redis.pipeline(transaction=True)  # MULTI … EXEC: one round trip, nothing run in between
        pipe.eval(_BOOK, len(keys), *keys, *args)
        _count(pipe, booking)
        done, counts = await self._run(pipe.execute())
        slot = None if booking.slot == UNNAMED_SLOT else booking.slot
        read = counted(counts[:4], slot, counts[4]) if isinstance(counts, list) and len(counts) == 5 else None
        return Booked(bool(done), read)

    async def forwarded(self, server: str) -> None:
        key = PREFIX + "forwards:" + server
        pipe = self._redis.pipeline(transaction=True)
        pipe.hsetnx(key, "epoch", secrets.token_hex(8))
        pipe.hincrby(key, "all", 1)
        pipe.hincrby(key, "unnamed", 1)
        pipe.pexpire(key, _COUNTS_TTL_MS)
        await self._run(pipe.execute())

    async def forwards(self, server: str, slot: int | None) -> Counted | None:
        fields = ["epoch", "all", "unnamed", f"slot:{slot if slot is not None else 0}"]
        return counted(await self._run(self._redis.hmget(PREFIX + "forwards:" + server, fields)), slot)

    async def renew(self, bookings: Sequence[Booking], lease_s: float) -> None:
        by_server: dict[str, list[str]] = {}
        for b in bookings:
            by_server.setdefault(b.server, []).append(b.member)
        if not by_server:
            return
        pipe = self._redis.pipeline(transaction=False)
        for server, members in by_server.items():
            pipe.eval(_RENEW, 1, PREFIX + "booked:" + server, int(lease_s * 1000), *members)
        await self._run(pipe.execute())

    async def release(self, booking: Booking) -> None:
        await self._run(self._redis.zrem(PREFIX + "booked:" + booking.server, booking.member))

    async def place(self, session_id: str, placement: SharedPlacement, slot: int | None, ttl_s: float) -> None:
        ttl_ms = int(ttl_s * 1000)
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(PREFIX + "place:" + session_id, placement.encode(), px=ttl_ms)
        if slot is not None:
            pipe.hset(PREFIX + "occupant:" + placement.server, str(slot), session_id)
            pipe.pexpire(PREFIX + "occupant:" + placement.server, ttl_ms)
        await self._run(pipe.execute())

    async def tell(self, news: News, ttl_s: float) -> None:
        ttl_ms, raw = int(ttl_s * 1000), encode(news)
        pipe = self._redis.pipeline(transaction=False)
        if isinstance(news, HeadSaved):
            pipe.set(PREFIX + "head:" + news.head, raw, px=ttl_ms)
            pipe.sadd(_HEADS, news.head)
            pipe.pexpire(_HEADS, ttl_ms)
        elif isinstance(news, HeadsGone) and news.heads:
            pipe.delete(*[PREFIX + "head:" + h for h in news.heads])
            pipe.srem(_HEADS, *news.heads)
        elif isinstance(news, SlotsErased):
            pipe.set(PREFIX + "erased:" + news.server, str(news.stamp_ns), px=ttl_ms)
        pipe.publish(NEWS, raw)
        await self._run(pipe.execute())

    async def published(self) -> list[News]:
        ids = [i.decode() for i in await self._run(self._redis.srandmember(_HEADS, _PUBLISHED_MAX))]
        if not ids:
            return []
        kept = await self._run(self._redis.mget([PREFIX + "head:" + i for i in ids]))
        if lapsed := [i for i, raw in zip(ids, kept, strict=True) if raw is None]:
            await self._run(self._redis.srem(_HEADS, *lapsed))
        return [n for raw in kept if (n := decode(raw)) is not None]

    async def listen(self) -> AsyncGenerator[News | None, None]:
        # A connection of its own, without the request path's short read timeout: it waits for news.
        listener: Any = aioredis.from_url(self._url, socket_connect_timeout=_TIMEOUT_S, health_check_interval=10)
        pubsub = listener.pubsub(ignore_subscribe_messages=True)
        try:
            await self._run(pubsub.subscribe(NEWS))
            yield None
            while True:
                message = await self._run(pubsub.get_message(timeout=5.0))
                if message is not None and (news := decode(message["data"])) is not None:
                    yield news
        finally:
            await pubsub.aclose()
            await listener.aclose()

    async def launched(self, servers: Sequence[str], proxy: str, lease_s: float) -> None:
        if not servers:
            return
        pipe = self._redis.pipeline(transaction=False)
        for server in servers:
            pipe.set(PREFIX + "launched:" + server, proxy, px=int(lease_s * 1000))
        await self._run(pipe.execute())

    async def unlaunched(self, servers: Sequence[str], proxy: str) -> None:
        if servers:
            keys = [PREFIX + "launched:" + s for s in servers]
            await self._run(self._redis.eval(_UNLAUNCH, len(keys), *keys, proxy))

    async def claim_warm(self, server: str, proxy: str, window_s: float) -> bool:
        keys = (PREFIX + "launched:" + server, PREFIX + "warm:" + server)
        return bool(await self._run(self._redis.eval(_CLAIM_WARM, 2, *keys, proxy, int(window_s * 1000))))

    async def close(self) -> None:
        await self._redis.aclose()
