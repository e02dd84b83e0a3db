"""Requests waiting on a server that stopped answering, ended rather than waited out.

Each forwarded request is booked under the server it waits on for as long as `forward` runs. When the health poll
marks a server down because it stopped answering (llama/health.py: a SIGSTOPped or wedged llama-server, whose
socket still accepts), every request booked on it is ended there and then: its task is cancelled with the reason
written on its booking, and `forward` takes that cancellation back and answers the client as it would a failed
upstream (a 503 before any byte went out, else its stream's error event). Without this a request that reached the
server before the poll found it hung waited out the read timeout (600 s by default).

The read timeout itself (`--read-timeout`) counts a server's silence towards this request: from the later of its
start and the end of the server's last answer to another one (`first_byte`), so a wait in llama-server's queue
behind a long answer is not taken for a hung server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
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


async def first_byte(sending: Awaitable[_T], silence_s: float | None, answered_at: Callable[[], float | None]) -> _T:
    """The server's answer, or TimeoutError once the server has been silent `silence_s` for this request: counted
    from the later of its start and the end of the server's last answer to another request (`answered_at`, None
    while it is answering one: this request waits its turn behind a long answer, on a server of one slot). A hung
    server is ended sooner by the health poll (`StrandedRequests.end`)."""
    if silence_s is None:
        return await sending
    loop, started = asyncio.get_running_loop(), time.monotonic()
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
            else:
                deadline.reschedule(loop.time())

        handle = loop.call_later(silence_s, check)
        try:
            return await sending
        finally:
            handle.cancel()


def unread(timeout: aiohttp.ClientTimeout) -> aiohttp.ClientTimeout:
    """`timeout` without its read timeout (`first_byte`, then `read_timeout`, take its place)."""
    return aiohttp.ClientTimeout(
        total=timeout.total,
        connect=timeout.connect,
        sock_connect=timeout.sock_connect,
        sock_read=None,
        ceil_threshold=timeout.ceil_threshold,
    )


def read_timeout(upstream_resp: aiohttp.ClientResponse, silence_s: float | None) -> None:
    """The body's reads time out after `silence_s` of silence, as aiohttp's `sock_read` would have timed them."""
    connection = upstream_resp.connection
    protocol = connection.protocol if connection is not None else None
    if protocol is not None and silence_s:
        protocol.read_timeout = silence_s
        protocol.start_timeout()
