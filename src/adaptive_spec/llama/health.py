"""The health of every llama-server the proxy forwards to: the poll that finds one dead or hung, and the watch that
finds it back.

Every POLL_S each distinct server URL serving a profile that is up is asked for its /health once (one llama-server may
carry several profiles, or be a replica of a pool); one that refuses, answers an error, or does not answer in TIMEOUT_S
twice in a row (six times while it holds as many requests as it keeps HTTP threads) is marked down for every profile on
it, so requests are refused at once (503) or routed elsewhere instead of waiting out the read timeout, and the requests
already waiting on it are ended (`on_down`: requests/forwarding/stranded.py). The watch asks each server marked down
that way every WATCH_S and marks its profiles up when it answers 200.

llama-server answers /health from its HTTP threads while a slot prefills or decodes (measured on the 0.5B at -t 1
prefilling 15k tokens, minutes on this CPU: every /health answered within 40 ms), so a long prefill is not a hang."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp

from adaptive_spec.llama.upstreams import Upstream, UpstreamTable

log = logging.getLogger(__name__)
# A hung server is found in 2 x (POLL_S + TIMEOUT_S) = 10 s at most (8 s at least). llama-server answers /health from
# its HTTP threads while it decodes or prefills: in ~1 ms, at most ~0.2 s on a loaded 2-core machine (b11434, -t 1).
POLL_S = 2.0
TIMEOUT_S = 3.0
_TIMEOUTS_TO_DOWN = 2  # a server too busy to answer once is not taken for dead: its sessions would re-prefill
# llama-server keeps n_parallel + 4 HTTP threads (b11434): with that many requests on it, a burst of them can leave
# jobs queued in its thread pool (seen with 8 sent at once to one slot), /health behind them until a running request
# ends or later connections drain the queue. Such a server has 6 rounds (30 s) to answer, not 2.
_SPARE_HTTP_THREADS = 4
_TIMEOUTS_TO_DOWN_QUEUED = 6
WATCH_S = 1.0
WATCH_TIMEOUT_S = 2.0

# A server's URL -> (requests the proxy has in flight on it, its slots), as the router counts them.
SlotUse = Callable[[str], tuple[int, int]]
# Why a replica that answers /health again may not take sessions (None: it may): llama/probe.py other_model.
Admit = Callable[[aiohttp.ClientSession, Upstream], Awaitable[str | None]]
# Told once per server the poll marks down (its URL, the reason): the requests waiting on it are ended there.
OnDown = Callable[[str, str], object]


def _nobody(_url: str, _reason: str) -> None:
    return None


async def _any_model(_client: aiohttp.ClientSession, _upstream: Upstream) -> str | None:
    return None


def _unknown_load(_url: str) -> tuple[int, int]:
    return 0, 1


def by_server(table: UpstreamTable, *, down: bool | None = None) -> dict[str, list[Upstream]]:
    """Each distinct server URL with the (profile, replica)s it serves: those up (`down` False), those down (True),
    or all (None). A server with none of them is left out."""
    servers: dict[str, list[Upstream]] = {}
    for u in table.all():
        if down is None or (table.replica_down_reason(u.name, u.replica) is not None) == down:
            servers.setdefault(u.base_url, []).append(u)
    return servers


def may_be_queued(in_flight: int, slots: int) -> bool:
    """Whether a server's /health may wait behind requests queued for its HTTP threads (busy, perhaps not hung)."""
    return in_flight >= slots + _SPARE_HTTP_THREADS


async def check(client: aiohttp.ClientSession, base_url: str, timeout_s: float) -> tuple[str | None, bool]:
    """Why the server is not healthy (None: it is), and whether that was only a timeout."""
    try:
        async with client.get(f"{base_url}/health", timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            return (None, False) if resp.status == 200 else (f"health check: HTTP {resp.status}", False)
    except TimeoutError:
        return f"health check: no answer in {timeout_s:g} s", True
    except aiohttp.ClientConnectorError:
        return "health check: connection refused", False
    except aiohttp.ClientError as exc:
        return f"health check: {type(exc).__name__}", False


async def poll_round(
    table: UpstreamTable,
    client: aiohttp.ClientSession,
    timeouts: dict[str, int],
    load: SlotUse = _unknown_load,
    on_down: OnDown = _nobody,
) -> None:
    """One round: each server with a profile up on it, asked once. `timeouts`: consecutive timeouts per server URL,
    kept between rounds; `on_down`: told of each server marked down."""
    servers = by_server(table, down=False)
    results = await asyncio.gather(*(check(client, url, TIMEOUT_S) for url in servers))
    for (url, upstreams), (reason, timed_out) in zip(servers.items(), results, strict=True):
        timeouts[url] = timeouts.get(url, 0) + 1 if timed_out else 0
        needed = _TIMEOUTS_TO_DOWN_QUEUED if timed_out and may_be_queued(*load(url)) else _TIMEOUTS_TO_DOWN
        if reason is None or (timed_out and timeouts[url] < needed):
            continue
        timeouts.pop(url, None)
        for u in upstreams:
            if table.replica_down_reason(u.name, u.replica) is None:  # a request may have said so first
                log.warning("%s at %s: %s; passed over until it answers", u.label, url, reason)
                table.mark_down(u.name, reason, u.replica, watch=True)
        on_down(url, reason)


async def watch_round(table: UpstreamTable, client: aiohttp.ClientSession, admit: Admit = _any_model) -> None:
    """Ask each server with a profile the proxy marked down itself (nobody else supervises it) for its /health, all
    at once, and mark those profiles up where it answers 200 and `admit` finds nothing wrong (a server that came back
    serving another model stays down, saying so): their sessions were re-placed, new ones may go there."""
    servers = {
        url: watched
        for url, down in by_server(table, down=True).items()
        if (watched := [u for u in down if (u.name, u.replica) in table.watched])
    }
    results = await asyncio.gather(*(check(client, url, WATCH_TIMEOUT_S) for url in servers))
    for (url, upstreams), (reason, _) in zip(servers.items(), results, strict=True):
        if reason is None:
            for u in upstreams:
                problem = await admit(client, u)
                if problem is None:
                    log.warning("%s at %s answers again; it takes sessions again", u.label, url)
                    table.mark_up(u.name, u.replica)
                elif table.replica_down_reason(u.name, u.replica) != problem:
                    log.warning("%s at %s %s; kept down", u.label, url, problem)
                    table.mark_down(u.name, problem, u.replica, watch=True)


@contextlib.asynccontextmanager
async def _every(seconds: float, work: Callable[[], Awaitable[None]], what: str) -> AsyncIterator[None]:
    """`work` every `seconds` for as long as the context is open: cancelled and awaited when it closes."""

    async def loop() -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                await work()
            except Exception:
                log.exception("%s failed", what)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def health_poll(
    table: UpstreamTable, client: aiohttp.ClientSession, load: SlotUse = _unknown_load, on_down: OnDown = _nobody
) -> contextlib.AbstractAsyncContextManager[None]:
    """The poll of every server, for as long as the context is open."""
    timeouts: dict[str, int] = {}
    return _every(POLL_S, lambda: poll_round(table, client, timeouts, load, on_down), "the health poll")


def replica_watch(
    table: UpstreamTable, client: aiohttp.ClientSession, admit: Admit = _any_model
) -> contextlib.AbstractAsyncContextManager[None]:
    """The watch of the servers the proxy marked down, for as long as the context is open."""
    return _every(WATCH_S, lambda: watch_round(table, client, admit), "the replica watch")
