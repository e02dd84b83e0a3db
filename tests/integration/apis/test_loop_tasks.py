"""The `/metrics` gauge of the asyncio tasks alive in the proxy's loop: it counts the streams in flight, and comes back
down once their clients have hung up (a task that outlived its request would keep it up). Streams held open on
demand are a fault a real llama-server cannot be made to produce, so an in-process fake upstream sends them."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer

from adaptive_spec.llama.upstreams import Upstream, UpstreamTable
from adaptive_spec.proxy.app import ProxySettings, build_app
from tests.support.fakes.fake_upstream import FakeUpstream
from tests.support.processes.servers import free_port

pytestmark = pytest.mark.asyncio(loop_scope="function")

BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
STREAMS = 4
_GAUGE = re.compile(rb"^adaptive_spec_event_loop_tasks (\S+)$", re.MULTILINE)


@pytest_asyncio.fixture(loop_scope="function")
async def proxy() -> AsyncIterator[tuple[FakeUpstream, TestServer]]:
    async with FakeUpstream() as fake:
        server = TestServer(build_app(UpstreamTable([Upstream("fake", fake.url)]), ProxySettings()), port=free_port())
        await server.start_server()
        yield fake, server
        await server.close()


async def _tasks(proxy: TestServer) -> int:
    """The gauge, scraped on a connection of its own (closed after it, so it leaves no connection task behind)."""
    async with aiohttp.ClientSession() as session, session.get(proxy.make_url("/metrics")) as resp:
        found = _GAUGE.search(await resp.read())
    assert found is not None, "no adaptive_spec_event_loop_tasks in /metrics"
    value = float(found.group(1))
    assert value == int(value) > 0
    return int(value)


async def test_the_loop_tasks_gauge_counts_streams_and_falls_back_after_hang_ups(
    proxy: tuple[FakeUpstream, TestServer],
) -> None:
    fake, server = proxy
    idle = await _tasks(server)
    sessions = [aiohttp.ClientSession() for _ in range(STREAMS)]
    try:
        url = server.make_url("/v1/chat/completions")
        streams = [await s.post(url, data=BODY, headers={"x-fault": "endless"}) for s in sessions]
        for resp in streams:
            assert resp.status == 200 and await resp.content.readany()
        # Each stream in flight holds at least its connection's handler task in the proxy.
        assert await _tasks(server) >= idle + STREAMS
        for resp in streams:
            resp.close()  # the client hangs up mid-answer
    finally:
        await asyncio.gather(*(s.close() for s in sessions))
    await asyncio.wait_for(fake.cancelled.wait(), 5)
    deadline = asyncio.get_running_loop().time() + 10
    while (now := await _tasks(server)) > idle:
        assert asyncio.get_running_loop().time() < deadline, f"{now} tasks 10 s after the hang-ups, {idle} before"
        await asyncio.sleep(0.05)
