"""The connections the proxy holds, as pure bookkeeping: each connection's phase (sending headers, sending its body,
being answered, idle) and since when, which of them are past their phase's bound, which to close past the cap, and the
cap that fits the process's descriptors.

No aiohttp, no clock of its own (the shell in `proxy/connections.py` passes the time in)."""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
# Descriptors the proxy needs besides its clients' connections: listening sockets, the sessions worker's pipes, the
# profiles' logs and pipes, the trace, policy files. Each client connection may need two: its own and its upstream's.
_OWN_DESCRIPTORS = 256


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    header_timeout_s: float = 10.0  # from connecting (or a kept-alive connection's next byte) to the headers' end
    body_timeout_s: float = 60.0  # from the headers' end to the body's
    keepalive_timeout_s: float = 75.0  # an idle connection between requests
    max_connections: int = 1024  # held at once; past it the slowest, then the idlest, is closed

    def describe(self) -> str:
        return (
            f"connections: headers within {self.header_timeout_s:g} s, a body within {self.body_timeout_s:g} s, "
            f"idle keep-alive {self.keepalive_timeout_s:g} s; at most {self.max_connections} at once (the slowest "
            "senders, then the idlest, closed first; answers are never cut)"
        )


class Phase(enum.Enum):
    HEADERS = "sending its headers"
    BODY = "sending its body"
    BUSY = "being answered"
    IDLE = "idle"
    CLOSING = "closing"


_BOUNDED = (Phase.HEADERS, Phase.BODY)


class ConnectionBook(Generic[K]):
    """Pure: each connection's phase and since when (the caller's clock), those past their phase's bound, and which
    one to close to make room. Each phase's table is in order of entry, so its expired entries are a prefix."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self._tables: dict[Phase, dict[K, float]] = {p: {} for p in Phase}
        self._phase: dict[K, Phase] = {}
        self._next_request: set[K] = set()  # bytes of another request came while this one was answered
        self.closed_for: Counter[str] = Counter()  # connections the book gave up on, by reason

    def __len__(self) -> int:
        return len(self._phase) - len(self._tables[Phase.CLOSING])

    def phase(self, key: K) -> Phase | None:
        return self._phase.get(key)

    def opened(self, key: K, now: float) -> K | None:
        """A new connection; the one to close to stay within the cap (another, or this one), or None."""
        self._enter(key, Phase.HEADERS, now)
        if len(self) <= self.limits.max_connections:
            return None
        slowest = [head for phase in _BOUNDED if (head := self._oldest(phase, besides=key)) is not None]
        victim = min(slowest, key=lambda head: head[0])[1] if slowest else next(iter(self._tables[Phase.IDLE]), key)
        self._close(victim, "room")
        return victim

    def _oldest(self, phase: Phase, besides: K) -> tuple[float, K] | None:
        return next(((since, k) for k, since in self._tables[phase].items() if k != besides), None)

    def bytes_received(self, key: K, now: float) -> None:
        """Bytes came; called before they are parsed. After a request's body they begin the next request."""
        phase = self._phase.get(key)
        if phase is Phase.IDLE:
            self._enter(key, Phase.HEADERS, now)
        elif phase is Phase.BUSY:
            self._next_request.add(key)

    def headers_received(self, key: K, now: float, body_done: bool) -> None:
        if self._phase.get(key) not in (None, Phase.CLOSING):
            self._enter(key, Phase.BUSY if body_done else Phase.BODY, now)

    def body_received(self, key: K, now: float) -> None:
        if self._phase.get(key) is Phase.BODY:
            self._enter(key, Phase.BUSY, now)

    def answered(self, key: K, now: float) -> None:
        """The request's handler is done: idle, or sending its next request if bytes of it came meanwhile."""
        if self._phase.get(key) in (Phase.BODY, Phase.BUSY):
            self._enter(key, Phase.HEADERS if key in self._next_request else Phase.IDLE, now)

    def closed(self, key: K) -> None:
        phase = self._phase.pop(key, None)
        if phase is not None:
            del self._tables[phase][key]
        self._next_request.discard(key)

    def expired(self, now: float) -> list[K]:
        """Connections past their phase's bound, marked closing: the caller closes them."""
        found: list[tuple[K, str]] = []
        bounds = (
            (Phase.HEADERS, self.limits.header_timeout_s, "headers"),
            (Phase.BODY, self.limits.body_timeout_s, "body"),
        )
        for phase, bound_s, reason in bounds:
            for key, since in self._tables[phase].items():
                if since + bound_s > now:
                    break
                found.append((key, reason))
        for key, reason in found:
            self._close(key, reason)
        return [key for key, _ in found]

    def _close(self, key: K, reason: str) -> None:
        self._enter(key, Phase.CLOSING, 0.0)
        self.closed_for[reason] += 1

    def _enter(self, key: K, phase: Phase, now: float) -> None:
        old = self._phase.get(key)
        if old is not None:
            del self._tables[old][key]
        self._phase[key] = phase
        self._tables[phase][key] = now  # a key entered again goes to the end: the tables stay in time order
        if phase is not Phase.BUSY:
            self._next_request.discard(key)


def descriptor_budget(max_connections: int, soft: int, hard: int | None) -> tuple[int, int]:
    """Pure: (the connection cap, the soft RLIMIT_NOFILE to ask for) for `max_connections`, given the process's
    limits (`hard` None: unlimited). A limit too low for the cap lowers the cap instead of running out of descriptors
    (then the proxy could not even connect to its profiles)."""
    need = 2 * max_connections + _OWN_DESCRIPTORS
    wanted = max(soft, need if hard is None else min(need, hard))
    return (max_connections if wanted >= need else max(1, (wanted - _OWN_DESCRIPTORS) // 2)), wanted
