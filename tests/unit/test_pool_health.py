"""The health poll of replica pools against a fake server that stalls on /health (a fault a real llama-server cannot
be made to show on demand): one late answer is forgiven, two in a row mark the replica down; a profile of one server
is never polled."""

from __future__ import annotations

import aiohttp
import pytest

from adaptive_spec.servers import pool_health
from adaptive_spec.servers.upstreams import Upstream, UpstreamTable
from tests.support.fake_upstream import FakeUpstream


@pytest.mark.asyncio(loop_scope="function")
async def test_a_replica_that_stops_answering_health_is_marked_down_after_two_polls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pool_health, "TIMEOUT_S", 0.05)
    servers = [FakeUpstream(), FakeUpstream()]
    a, b = [await server.start() for server in servers]
    try:
        table = UpstreamTable([Upstream("pool", a), Upstream("pool", b), Upstream("single", a)])
        timeouts: dict[tuple[str, int], int] = {}
        async with aiohttp.ClientSession() as client:
            await pool_health.poll_pools(table, client, timeouts)
            asked = sum(server.health_asked for server in servers)
            assert asked == 2 and table.replica_down_reason("pool", 0) is None  # the single one is not asked
            for server in servers:
                server.health_delay_s = 1.0
            await pool_health.poll_pools(table, client, timeouts)
            assert table.replica_down_reason("pool", 0) is None  # one late answer: busy, not dead
            await pool_health.poll_pools(table, client, timeouts)
            assert table.replica_down_reason("pool", 0) == "health check: no answer in 0.05 s"
            # Both stalled: both handed to the replica watch, which brings them back when they answer.
            assert ("pool", 0) in table.watched and ("pool", 1) in table.watched
    finally:
        for server in servers:
            await server.close()
