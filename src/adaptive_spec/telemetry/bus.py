"""Fan-out of events to live subscribers, each with its own bounded queue: a slow one loses its oldest events."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

from adaptive_spec.telemetry.events import Event, EventsDropped

log = logging.getLogger(__name__)


class Subscription:
    def __init__(self, limit: int) -> None:
        self._queue: deque[Event] = deque()
        self._limit = limit
        self._ready = asyncio.Event()
        self.dropped = 0
        self.closed = False

    def _put(self, event: Event) -> None:
        if len(self._queue) >= self._limit:
            self._queue.popleft()
            self.dropped += 1
        self._queue.append(event)
        self._ready.set()

    async def next_batch(self) -> list[Event]:
        """Waits for events; returns them (led by an EventsDropped when some were lost), or [] once closed."""
        while not self._queue and not self.closed:
            self._ready.clear()
            await self._ready.wait()
        batch: list[Event] = []
        if self.dropped:
            batch.append(EventsDropped(count=self.dropped))
            self.dropped = 0
        batch.extend(self._queue)
        self._queue.clear()
        return batch

    def close(self) -> None:
        self.closed = True
        self._ready.set()


class EventBus:
    def __init__(self, queue_limit: int = 1000) -> None:
        self._subs: set[Subscription] = set()
        self._limit = queue_limit
        self._listeners: list[Callable[[Event], None]] = []

    def listen(self, listener: Callable[[Event], None]) -> None:
        """A synchronous consumer of every event (the Prometheus metrics), called in publish order."""
        self._listeners.append(listener)

    def publish(self, event: Event) -> None:
        for listener in self._listeners:
            try:
                listener(event)
            except Exception:  # one broken consumer must not cost the others (or the request) their events
                log.exception("event listener %r failed on %s", listener, type(event).__name__)
        for sub in self._subs:
            sub._put(event)

    def subscribe(self) -> Subscription:
        sub = Subscription(self._limit)
        self._subs.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subs.discard(sub)
        sub.close()

    def close_all(self) -> None:
        for sub in list(self._subs):
            self.unsubscribe(sub)

    @property
    def subscribers(self) -> int:
        return len(self._subs)
