"""The health poll of replica pools: every few seconds each replica of a pool that is up is asked for its /health
(short timeout), so a server that died is passed over before a request is sent to it. A replica found down is handed
to the replica watch (`app._replica_watch`), which marks it up again when it answers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import aiohttp

from adaptive_spec.servers.upstreams import Upstream, UpstreamTable

log = logging.getLogger(__name__)
POLL_S = 3.0
TIMEOUT_S = 2.0
_TIMEOUTS_TO_DOWN = 2  # a server too busy to answer once is not taken for dead: its sessions would re-prefill


async def _check(client: aiohttp.ClientSession, upstream: Upstream) -> tuple[str | None, bool]:
    """Why the replica is not healthy (None: it is), and whether that was only a timeout."""
    try:
        async with client.get(f"{upstream.base_url}/health", timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as resp:
            return (None, False) if resp.status == 200 else (f"health check: HTTP {resp.status}", False)
    except TimeoutError:
        return f"health check: no answer in {TIMEOUT_S:g} s", True
    except aiohttp.ClientConnectorError:
        return "health check: connection refused", False
    except aiohttp.ClientError as exc:
        return f"health check: {type(exc).__name__}", False


async def poll_pools(table: UpstreamTable, client: aiohttp.ClientSession, timeouts: dict[tuple[str, int], int]) -> None:
    """One round: the replicas that are up, of every profile with more than one. `timeouts`: consecutive timeouts
    per replica, kept between rounds."""
    up = [u for name in table.names() if len(table.replicas(name)) > 1 for u in table.replicas(name)]
    up = [u for u in up if table.replica_down_reason(u.name, u.replica) is None]
    results = await asyncio.gather(*(_check(client, u) for u in up))
    for upstream, (reason, timed_out) in zip(up, results, strict=True):
        key = (upstream.name, upstream.replica)
        timeouts[key] = timeouts.get(key, 0) + 1 if timed_out else 0
        if reason is None or (timed_out and timeouts[key] < _TIMEOUTS_TO_DOWN):
            continue
        timeouts.pop(key, None)
        if table.replica_down_reason(upstream.name, upstream.replica) is None:  # a request may have said so first
            log.warning("%s at %s: %s; passed over until it answers", upstream.label, upstream.base_url, reason)
            table.mark_down(upstream.name, reason, upstream.replica, watch=True)


@contextlib.asynccontextmanager
async def pool_health_poll(table: UpstreamTable, client: aiohttp.ClientSession) -> AsyncIterator[None]:
    """The poll for as long as the context is open: cancelled and awaited when it closes."""

    async def loop() -> None:
        timeouts: dict[tuple[str, int], int] = {}
        while True:
            await asyncio.sleep(POLL_S)
            try:
                await poll_pools(table, client, timeouts)
            except Exception:
                log.exception("the health poll of replica pools failed")

    task = asyncio.create_task(loop())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
