"""Requests waiting on a server that stopped answering, ended rather than waited out.

Each forwarded request is booked under the server it waits on for as long as `forward` runs. When the health poll
marks a server down because it stopped answering (llama/health.py: a SIGSTOPped or wedged llama-server, whose
socket still accepts), every request booked on it is ended there and then: its task is cancelled with the reason
written on its booking, and `forward` takes that cancellation back and answers the client as it would a failed
upstream (a 503 before any byte went out, else its stream's error event). Without this a request that reached the
server before the poll found it hung waited out the read timeout (600 s by default)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

from aiohttp import web

from adaptive_spec.requests.outcome import Outcome

log = logging.getLogger(__name__)


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
