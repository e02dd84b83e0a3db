"""The health poll of every server and the replica watch, against fake servers that stall on /health (a fault a real
llama-server cannot be made to show on demand; tests/integration/reliability/test_hung_server.py stops a real one):
each server URL is asked once a round whatever the profiles on it; one late answer is forgiven, two in a row mark every
profile on the server down; a server with as many requests on it as llama-server keeps HTTP threads has six rounds; the
watch asks each server once and brings back every profile on it that the proxy marked down itself."""

from __future__ import annotations

import aiohttp
import pytest

from adaptive_spec.llama import health as pool_health
from adaptive_spec.llama.upstreams import Upstream, UpstreamTable
from tests.support.fakes.fake_upstream import FakeUpstream
from tests.support.processes.servers import free_port

pytestmark = pytest.mark.asyncio(loop_scope="function")


async def test_a_server_that_stops_answering_health_is_marked_down_for_every_profile_on_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pool_health, "TIMEOUT_S", 0.05)
    servers = [FakeUpstream(), FakeUpstream()]
    a, b = [await server.start() for server in servers]
    try:
        # "single" is a second profile on the pool's first server (per-request settings of one llama-server).
        table = UpstreamTable([Upstream("pool", a), Upstream("pool", b), Upstream("single", a)])
        timeouts: dict[str, int] = {}
        async with aiohttp.ClientSession() as client:
            await pool_health.poll_round(table, client, timeouts)
            assert [server.health_asked for server in servers] == [1, 1]  # each server once, not each profile
            assert table.replica_down_reason("pool", 0) is None
            servers[0].health_delay_s = 1.0
            await pool_health.poll_round(table, client, timeouts)
            assert table.replica_down_reason("single") is None  # one late answer: busy, not dead
            await pool_health.poll_round(table, client, timeouts)
            for name, replica in (("pool", 0), ("single", 0)):
                assert table.replica_down_reason(name, replica) == "health check: no answer in 0.05 s"
                assert (name, replica) in table.watched  # handed to the replica watch
            assert table.replica_down_reason("pool", 1) is None
            assert table.down_reason("single") is not None and table.down_reason("pool") is None
    finally:
        for server in servers:
            await server.close()


@pytest.mark.parametrize(("in_flight", "rounds"), [(4, 2), (5, 6)])
async def test_a_server_with_requests_queued_for_its_http_threads_has_longer_to_answer(
    monkeypatch: pytest.MonkeyPatch, in_flight: int, rounds: int
) -> None:
    """One slot: llama-server keeps 1 + 4 HTTP threads; with 5 requests on it /health may wait behind them."""
    monkeypatch.setattr(pool_health, "TIMEOUT_S", 0.05)
    async with FakeUpstream() as server:
        server.health_delay_s = 1.0
        table = UpstreamTable([Upstream("solo", server.url)])
        timeouts: dict[str, int] = {}
        async with aiohttp.ClientSession() as client:
            for _ in range(rounds - 1):
                await pool_health.poll_round(table, client, timeouts, lambda _url: (in_flight, 1))
            assert table.down_reason("solo") is None
            await pool_health.poll_round(table, client, timeouts, lambda _url: (in_flight, 1))
            assert table.down_reason("solo") == "health check: no answer in 0.05 s"


async def test_a_refused_connection_marks_a_single_server_down_in_one_round() -> None:
    table = UpstreamTable([Upstream("solo", f"http://127.0.0.1:{free_port()}")])
    async with aiohttp.ClientSession() as client:
        await pool_health.poll_round(table, client, {})
    assert table.down_reason("solo") == "health check: connection refused"


async def test_the_watch_asks_each_server_once_and_brings_back_the_profiles_it_marked_down() -> None:
    async with FakeUpstream() as server:
        table = UpstreamTable([Upstream("a", server.url), Upstream("b", server.url), Upstream("c", server.url)])
        table.mark_down("a", "health check: no answer in 3 s", watch=True)
        table.mark_down("b", "health check: no answer in 3 s", watch=True)
        table.mark_down("c", "restarting on request")  # its launcher supervises it: the watch leaves it be
        async with aiohttp.ClientSession() as client:
            await pool_health.watch_round(table, client)
        assert server.health_asked == 1
        assert table.down_reason("a") is None and table.down_reason("b") is None and not table.watched
        assert table.down_reason("c") == "restarting on request"
