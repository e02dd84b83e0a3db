"""Requests waiting on a server that stopped answering, ended rather than waited out.

Each forwarded request is booked under the server it waits on for as long as `forward` runs. When the health poll
marks a server down because it stopped answering (llama/health.py: a SIGSTOPped or wedged llama-server, whose
socket still accepts), every request booked on it is ended there and then: its task is cancelled with the reason
written on its booking, and `forward` takes that cancellation back and answers the client as it would a failed
upstream (a 503 before any byte went out, else its stream's error event). Without this a request that reached the
server before the poll found it hung waited out the read timeout (600 s by default).

The read timeout itself (`--read-timeout`) counts a server's silence towards this request: from the later of its
start and the end of the server's last answer to another one (`first_byte`), so a wait in llama-server's queue
behind a long answer is not taken for a hung server. Nor is a server at work on it: an answer sent whole at its end
(no stream), or a long prefill before a stream's first token, keeps the server silent for as long as it takes on a
slow machine, and llama-server itself sets no limit there. So once the silence has lasted, the server is asked
(`at_work`): its HTTP side answers `/health` at once and its main loop answers `/slots` with a slot processing; then
the silence counts again from there. A stopped server answers neither, a wedged main loop no `/slots`: they time out
as before (with the time of that check added)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

import aiohttp
from aiohttp import web

from adaptive_spec.requests.forwarding.outcome import Outcome

log = logging.getLogger(__name__)
_T = TypeVar("_T")


@dataclass(eq=False, slots=True)
class Booking:
    """One request's wait on one server: its task, and why the proxy ended it (None: it did not)."""

    task: asyncio.Task[object] | None
    server: str
    label: str  # the profile (and replica) the request was sent to, for the message
    ended: str | None = None
    answered: bool = False  # the server's answer to it has begun (its headers came)

    def outcome(self) -> Outcome:
        """How the request ended, for its record and its answer: another replica may take it (nothing was sent)."""
        message = (
            f"profile {self.label!r} at {self.server} stopped answering ({self.ended}); "
            "the request was ended rather than waited out"
        )
        return Outcome(503, message, "upstream_unresponsive", unreachable=True)


class StrandedRequests:
    """The requests in flight on each server (its base URL), for the health poll to end when that server hangs."""

    def __init__(self) -> None:
        self._by_server: dict[str, set[Booking]] = {}
        self._answered_until: dict[str, float] = {}  # when each server last ended an answer (time.monotonic)

    @contextlib.contextmanager
    def book(self, server: str, label: str) -> Iterator[Booking]:
        """The current task booked on `server` for the block."""
        booking = Booking(asyncio.current_task(), server, label)
        on_server = self._by_server.setdefault(server, set())
        on_server.add(booking)
        try:
            yield booking
        finally:
            on_server.discard(booking)
            if booking.answered:
                self._answered_until[server] = time.monotonic()
            if not on_server:
                self._by_server.pop(server, None)

    def waiting_on(self, server: str) -> int:
        return len(self._by_server.get(server, ()))

    def answered_at(self, server: str, besides: Booking) -> float | None:
        """When `server` last answered another request than `besides` (time.monotonic; None: it is answering one
        now). A request without an answer yet is queued behind such answers (one slot, or all of them busy): its
        server's silence counts from their end, not from its own start."""
        if any(b.answered and b is not besides for b in self._by_server.get(server, ())):
            return None
        return self._answered_until.get(server, float("-inf"))

    def end(self, server: str, reason: str) -> int:
        """End every request waiting on `server` (once each); returns how many were ended."""
        ended = 0
        for booking in list(self._by_server.get(server, ())):
            if booking.ended is not None or booking.task is None or booking.task.done():
                continue
            booking.ended = reason
            booking.task.cancel(f"{server} stopped answering")
            ended += 1
        if ended:
            log.warning("%s stopped answering (%s): ended the %d requests waiting on it", server, reason, ended)
        return ended


STRANDED = web.AppKey("stranded", StrandedRequests)


AtWork = Callable[[float], Awaitable[bool]]  # whether the server is at work, found out within that many seconds

_HEALTH_WAIT_S = 2.0  # /health is answered by llama-server's HTTP threads: at once, unless the process is stopped


async def at_work(client: aiohttp.ClientSession, base_url: str, keys: Mapping[str, str], wait_s: float) -> bool:
    """Whether the llama-server at `base_url` is at work: `/health` answered at once and, within `wait_s` (its main
    loop answers between two decodes), `/slots` with a slot processing (asked with the request's own key headers,
    `keys`, for a server that takes one). False for a stopped server, a wedged main loop, an idle one (it lost the
    request), and one that keeps `/slots` off (`--no-slots`): their silence counts."""
    try:
        async with client.get(base_url + "/health", timeout=aiohttp.ClientTimeout(total=_HEALTH_WAIT_S)) as r:
            if r.status != 200:
                return False
        wait = aiohttp.ClientTimeout(total=max(0.1, wait_s))
        async with client.get(base_url + "/slots", headers=keys, timeout=wait) as r:
            slots = await r.json() if r.status == 200 else None
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return False
    return isinstance(slots, list) and any(isinstance(s, dict) and s.get("is_processing") for s in slots)


async def first_byte(
    sending: Awaitable[_T],
    silence_s: float | None,
    answered_at: Callable[[], float | None],
    working: AtWork | None = None,
) -> _T:
    """The server's answer, or TimeoutError once the server has been silent `silence_s` for this request: counted
    from the later of its start and the end of the server's last answer to another request (`answered_at`, None
    while it is answering one: this request waits its turn behind a long answer, on a server of one slot), and
    again from each check that found the server at work (`working`: a prefill or a whole answer takes its time). A
    hung server is ended sooner by the health poll (`StrandedRequests.end`)."""
    if silence_s is None:
        return await sending
    loop, started = asyncio.get_running_loop(), time.monotonic()
    asking: set[asyncio.Task[None]] = set()
    # Awaited directly (no task in between: the answer's first chunks are read as soon as they come); a check at
    # each deadline either moves it or lets it fire.
    async with asyncio.timeout(None) as deadline:
        handle: asyncio.TimerHandle

        def check() -> None:
            nonlocal handle
            last = answered_at()
            since = max(started, last) if last is not None else time.monotonic()
            left = since + silence_s - time.monotonic()
            if left > 0:
                handle = loop.call_later(left, check)
            elif working is None:
                deadline.reschedule(loop.time())
            else:
                task = loop.create_task(ask())
                asking.add(task)
                task.add_done_callback(asking.discard)

        async def ask() -> None:
            nonlocal started, handle
            assert working is not None
            if await working(silence_s):
                started = time.monotonic()
                handle = loop.call_later(silence_s, check)
            else:
                deadline.reschedule(loop.time())

        handle = loop.call_later(silence_s, check)
        try:
            return await sending
        finally:
            handle.cancel()
            for task in asking:
                task.cancel()


def unread(timeout: aiohttp.ClientTimeout) -> aiohttp.ClientTimeout:
    """`timeout` without its read timeout (`first_byte`, then `read_timeout`, take its place)."""
    return aiohttp.ClientTimeout(
        total=timeout.total,
        connect=timeout.connect,
        sock_connect=timeout.sock_connect,
        sock_read=None,
        ceil_threshold=timeout.ceil_threshold,
    )


@contextlib.asynccontextmanager
async def read_timeout(
    upstream_resp: aiohttp.ClientResponse, silence_s: float | None, working: AtWork | None = None
) -> AsyncIterator[None]:
    """Within the block the body's reads time out after `silence_s` of silence, as aiohttp's `sock_read` would have
    timed them, except while the server is at work (`working`, asked every third of the silence: a stream's first
    token after a long prefill, on a server that sent its headers at once)."""
    connection = upstream_resp.connection
    protocol = connection.protocol if connection is not None else None
    if protocol is None or not silence_s:
        yield
        return
    protocol.read_timeout = silence_s
    protocol.start_timeout()
    if working is None:
        yield
        return

    async def renew() -> None:
        while True:
            await asyncio.sleep(silence_s / 3)
            if await working(silence_s / 3):
                protocol.start_timeout()  # the silence counts again from now

    renewing = asyncio.get_running_loop().create_task(renew())
    try:
        yield
    finally:
        renewing.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await renewing
