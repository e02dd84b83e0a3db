"""The health poll of replica pools against a fake server that stalls on /health (a fault a real llama-server cannot
be made to show on demand): one late answer is forgiven, two in a row mark the replica down; a profile of one server
is never polled."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from adaptive_spec.servers import pool_health
from adaptive_spec.servers.upstreams import Upstream, UpstreamTable
from tests.support.servers import free_port


@pytest.mark.asyncio(loop_scope="function")
async def test_a_replica_that_stops_answering_health_is_marked_down_after_two_polls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pool_health, "TIMEOUT_S", 0.05)
    asked: list[str] = []
    stall = asyncio.Event()

    async def health(request: web.Request) -> web.Response:
        asked.append(request.host)
        if stall.is_set():
            await asyncio.sleep(1.0)
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/health", health)
    servers = [TestServer(app, port=free_port()) for _ in range(2)]
    for server in servers:
        await server.start_server()
    a, b = (f"http://127.0.0.1:{server.port}" for server in servers)
    try:
        table = UpstreamTable([Upstream("pool", a), Upstream("pool", b), Upstream("single", a)])
        timeouts: dict[tuple[str, int], int] = {}
        async with aiohttp.ClientSession() as client:
            await pool_health.poll_pools(table, client, timeouts)
            assert len(asked) == 2 and table.replica_down_reason("pool", 0) is None  # the single one is not asked
            stall.set()
            await pool_health.poll_pools(table, client, timeouts)
            assert table.replica_down_reason("pool", 0) is None  # one late answer: busy, not dead
            await pool_health.poll_pools(table, client, timeouts)
            assert table.replica_down_reason("pool", 0) == "health check: no answer in 0.05 s"
            # Both stalled: both handed to the replica watch, which brings them back when they answer.
            assert ("pool", 0) in table.watched and ("pool", 1) in table.watched
    finally:
        for server in servers:
            await server.close()
