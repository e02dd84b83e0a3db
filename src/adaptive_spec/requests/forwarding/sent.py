"""What a request's forwards sent and heard: the body one forward sends (`Sent`, a value) and the sending stage's
running tally of the request's forwards (`Forwards`: the last one's `Sent` and answer meter, the counts not seen).

Pure."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from adaptive_spec.streams.meter import ResponseMeter
from adaptive_spec.streams.output import LiveText
from adaptive_spec.telemetry.ledger import Counts


@dataclass(frozen=True, slots=True)
class Sent:
    """The body one forward sends upstream, as `upstream_body` (requests/outgoing.py) decides it: its bytes, whether
    the per-token timings it asks for are taken out of the answer again (`strip`: the client did not ask for them),
    and the per-request speculation fields it carries, for the record (None: none named)."""

    body: bytes
    strip: bool = False
    speculation: dict[str, Any] | None = None


class Forwards:
    """The sending stage's running tally of one request's forwards (one, or more after a failover), written by that
    stage alone (`begin` before a forward, `ended` after it) and read by the rest: the last forward's `Sent` body, the
    meter of its answer (a new one each forward: a request failed over is recorded as its last forward), and
    llama-server's counts for each forward whose answer was not seen to its end (settled once a quiet reading says
    them). A tally, not a value: the meter fills while the answer is relayed."""

    __slots__ = ("_meter", "_sent", "_unseen")

    def __init__(self) -> None:
        self._sent: Sent | None = None
        self._meter = ResponseMeter()  # a request never forwarded: an empty answer
        self._unseen: list[asyncio.Future[Counts | None]] = []

    @property
    def sent(self) -> Sent | None:
        return self._sent

    @property
    def meter(self) -> ResponseMeter:
        return self._meter

    @property
    def unseen(self) -> tuple[asyncio.Future[Counts | None], ...]:
        return tuple(self._unseen)

    def begin(self, sent: Sent, live: LiveText | None = None) -> ResponseMeter:
        """A forward of `sent` begins: the meter its answer fills (`live`: the answer's text for the live feed)."""
        self._sent, self._meter = sent, ResponseMeter()
        self._meter.live = live
        return self._meter

    def ended(self, unseen: asyncio.Future[Counts | None] | None) -> None:
        """A forward ended; `unseen`: llama-server's counts for it, when its answer was not seen to its end."""
        if unseen is not None:
            self._unseen.append(unseen)
