"""The ledger's shell: each forward and its end told to it, the record of an answer not seen to its end held until
llama-server's counters (read when the server is quiet: before the next forward, or in the background) say its
prompt, tokens and drafts.

So the records, and the proxy's /metrics made from them, add up to llama-server's own counts (telemetry/ledger.py).
While requests the proxy forwarded are open there (a client's retry of the very request that hung up, say), the
reading waits for them to end: their answers say their own counts, so the quiet moment after them still settles the
one it waits for. A server busy with work of another client for `SETTLE_S` while the proxy has nothing open there, or
a wait of `HOLD_S` in all, gives up (the record keeps what the stream showed); a server without `--metrics` (an
attached one may have none) is never asked twice."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

import aiohttp

from adaptive_spec.requests.forwarding.outcome import Outcome
from adaptive_spec.streams.meter import ResponseMeter
from adaptive_spec.telemetry.ledger import Counts, Ledger, busy, from_metrics
from adaptive_spec.telemetry.records import Timings

log = logging.getLogger(__name__)

SETTLE_S = 30.0  # polled this long while the proxy has nothing open there and the server is never quiet
HOLD_S = 900.0  # a record's counts are waited for this long at most, however busy the proxy keeps the server
BEFORE_S = 2.0  # a one-slot server ends the cancelled task first anyway; a busier one is read later
_POLL_S = 0.05
_TIMEOUT = aiohttp.ClientTimeout(total=5)
_ASK_TIMEOUT = aiohttp.ClientTimeout(total=0.5)  # on a request's path: a server that takes longer is not waited for


def usage_of(timings: Timings | None) -> Counts | None:
    """The token counts an answer with usage only did say (prompt, cached, predicted), to check a reading with."""
    if timings is None or not timings.from_usage:
        return None
    return Counts(timings.prompt_n, timings.cache_n, timings.predicted_n)


def counts_of(timings: Timings | None, generating: bool) -> Counts | None:
    """What an answer said llama-server counted; None when it did not say it all (no final timings, or only the
    usage object, which has no draft counts)."""
    if not generating:
        return Counts()
    if timings is None or timings.from_usage:
        return None
    return Counts(
        timings.prompt_n,
        timings.cache_n,
        timings.predicted_n,
        timings.draft_n,
        timings.draft_n_accepted,
        timings.prompt_ms,
        timings.predicted_ms,
    )


def forward_counts(generates: bool, meter: ResponseMeter, outcome: Outcome | None) -> Counts | None:
    """What the answer said llama-server counted for one forward; None where it may have done work the answer did
    not show (a client that hung up, a stream cut, a task ended): the ledger's next quiet reading says it."""
    if not generates:
        return Counts()
    if outcome is not None and outcome.finished:
        return counts_of(meter.timings, True)
    if outcome is not None and not outcome.client_gone and outcome.status >= 400 and meter.pieces == 0:
        return Counts()  # refused before any work (a 4xx from llama-server, nothing reached): nothing counted
    return None


def with_counts(timings: Timings | None, counts: Counts) -> Timings:
    """The record's timings with what llama-server counted for the request (speeds from its own seconds)."""
    base = timings or Timings()
    speed = counts.predicted_n / (counts.predicted_ms / 1000.0) if counts.predicted_ms > 0 else 0.0
    return replace(
        base,
        prompt_n=counts.prompt_n,
        cache_n=counts.cache_n,
        predicted_n=counts.predicted_n,
        draft_n=counts.draft_n,
        draft_n_accepted=counts.draft_n_accepted,
        prompt_ms=round(counts.prompt_ms, 3),
        predicted_ms=round(counts.predicted_ms, 3),
        predicted_per_second=speed,
        from_usage=False,
    )


class Accounting:
    def __init__(self, settle_s: float = SETTLE_S, hold_s: float = HOLD_S) -> None:
        self.ledger = Ledger()
        self._settle_s, self._hold_s = settle_s, hold_s
        self._waiting_since: dict[str, float] = {}  # per server, when its oldest unsettled request ended
        self._waiting: dict[str, asyncio.Future[Counts | None]] = {}
        self._readers: dict[str, asyncio.Task[None]] = {}
        self._no_metrics: set[str] = set()
        self._baselined: set[str] = set()

    def forwarded(self, server: str) -> None:
        self.ledger.forwarded(server)

    def ended(
        self,
        client: aiohttp.ClientSession,
        server: str,
        request_id: str,
        counts: Counts | None,
        known: Counts | None = None,
    ) -> asyncio.Future[Counts | None] | None:
        """A forwarded request ended. A future when its counts wait for the next quiet reading (its record is
        counted again then), else None. `known`: the token counts its answer did say (usage), checked then."""
        if server in self._no_metrics:
            self.ledger.ended(server, request_id, Counts() if counts is None else counts)
            return None
        held = self.ledger.ended(server, request_id, counts, known)
        future: asyncio.Future[Counts | None] | None = None
        if held:
            future = asyncio.get_running_loop().create_future()
            self._waiting[request_id] = future
            self._waiting_since.setdefault(server, time.monotonic())
        # The last of the proxy's requests there to end starts the reading that one before it waits for.
        waiting = held or self.ledger.waiting(server)
        if (waiting or server not in self._baselined) and self.ledger.quiet(server) is not None:
            self._read_soon(client, server)
        return future

    def _read_soon(self, client: aiohttp.ClientSession, server: str) -> None:
        if server in self._readers:
            return
        task = asyncio.get_running_loop().create_task(self._read(client, server))
        self._readers[server] = task
        task.add_done_callback(lambda _t: self._readers.pop(server, None))

    async def before_forward(self, client: aiohttp.ClientSession, server: str) -> None:
        """Before a request goes to a server whose last answers were not seen to their end, and that is quiet for the
        proxy: one reading first (a millisecond; up to `BEFORE_S` while the server ends a cancelled task), so the
        next request's counts do not mix with theirs; before its first forward, one try for the baseline. A server
        that does not answer at once (down, hung) is not waited for: the background reading goes on."""
        first = server not in self._baselined  # the first forward there: the counters read before it, once
        waiting = self.ledger.waiting(server)
        if not (waiting or first) or server in self._no_metrics or self.ledger.quiet(server) is None:
            return
        deadline = time.monotonic() + (BEFORE_S if waiting else 0.0)
        for _ in range(int(BEFORE_S / (_POLL_S / 2)) + 1):  # polled: llama-server tells no event of its counters
            read = await self._read_once(client, server, _ASK_TIMEOUT)
            if read != "busy" or time.monotonic() >= deadline:
                return
            await asyncio.sleep(_POLL_S / 2)

    async def _read(self, client: aiohttp.ClientSession, server: str) -> None:
        """Polled until a quiet reading settles what waits. Stops while the proxy's own requests are open there (the
        last to end starts it again); gives up after `SETTLE_S` of a server busy with nothing of the proxy's open,
        or `HOLD_S` since the oldest waiting request ended."""
        alone, pause = 0.0, _POLL_S
        give_up_at = self._waiting_since.get(server, time.monotonic()) + self._hold_s
        while alone < self._settle_s and time.monotonic() < give_up_at:
            if self.ledger.quiet(server) is None:
                return
            began = time.monotonic()
            read = await self._read_once(client, server, _TIMEOUT)
            if (read == "settled" and not self.ledger.waiting(server)) or read == "none":
                return
            await asyncio.sleep(pause)
            alone += time.monotonic() - began
            pause = min(1.0, pause * 2)  # a server busy for long is asked once a second, not twenty times
        if self.ledger.waiting(server):  # never quiet for long enough: its counters start from the next reading
            self._baselined.discard(server)
            self._forget(server)

    async def _read_once(self, client: aiohttp.ClientSession, server: str, patience: aiohttp.ClientTimeout) -> str:
        """One reading, if the server is quiet: "settled" (it was, and settled what waited), "busy" (not quiet, or
        processing), "down" (no answer in time), "none" (no /metrics there)."""
        started_at = self.ledger.quiet(server)
        if started_at is None:
            return "busy"
        values = await self._metrics(client, server, patience)
        if values is None:  # no /metrics: what the streams showed is all there is
            self._no_metrics.add(server)
            self._forget(server)
            return "none"
        if not values:
            return "down"
        counters = from_metrics(values) if not busy(values) else None
        settled = self.ledger.read(server, started_at, counters) if counters is not None else None
        if settled is None:
            return "busy"
        self._baselined.add(server)
        self._waiting_since.pop(server, None)  # a reading settles every request that waited
        if settled.other is not None:
            log.debug("%s counted %s that no request through the proxy did", server, settled.other)
        for request_id in settled.requests:
            self._settle(request_id, settled.counts if len(settled.requests) == 1 else None)
        return "settled"

    async def _metrics(
        self, client: aiohttp.ClientSession, server: str, patience: aiohttp.ClientTimeout
    ) -> dict[str, float] | None:
        try:
            async with client.get(f"{server}/metrics", timeout=patience) as resp:
                if resp.status in (404, 501):
                    return None
                if resp.status != 200:
                    return {}
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError):
            return {}
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("llamacpp:"):
                name, _, value = line.partition(" ")
                try:
                    values[name] = float(value)
                except ValueError:
                    continue
        return values if from_metrics(values) is not None else None  # not llama-server's counters: none to read

    def _forget(self, server: str) -> None:
        self._waiting_since.pop(server, None)
        for request_id in self.ledger.forget(server):
            self._settle(request_id, None)

    def _settle(self, request_id: str, counts: Counts | None) -> None:
        future = self._waiting.pop(request_id, None)
        if future is not None and not future.done():
            future.set_result(counts)

    async def close(self) -> None:
        for task in list(self._readers.values()):
            task.cancel()
        await asyncio.gather(*self._readers.values(), return_exceptions=True)
        for request_id in list(self._waiting):
            self._settle(request_id, None)
