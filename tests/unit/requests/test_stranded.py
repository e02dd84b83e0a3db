"""The requests waiting on each server, ended when the health poll finds that server hung
(requests/forwarding/stranded.py): each request is ended once, with the reason on its booking; a booking lasts as long
as its block; the poll tells `on_down` of each server it marks down, once, and of no other."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from adaptive_spec.llama import health as pool_health
from adaptive_spec.llama.upstreams import Upstream, UpstreamTable
from adaptive_spec.requests.forwarding.stranded import StrandedRequests
from tests.support.fakes.fake_upstream import FakeUpstream

pytestmark = pytest.mark.asyncio(loop_scope="function")
URL = "http://127.0.0.1:1"


async def test_the_requests_on_a_hung_server_are_ended_once_each_and_only_theirs() -> None:
    stranded = StrandedRequests()
    endings: dict[str, str | None] = {}

    async def waiting(name: str, server: str) -> None:
        with stranded.book(server, name) as booking:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                endings[name] = booking.ended
                raise

    tasks = {name: asyncio.create_task(waiting(name, server)) for name, server in [("a", URL), ("b", URL), ("c", "x")]}
    await asyncio.sleep(0)
    assert stranded.waiting_on(URL) == 2 and stranded.waiting_on("x") == 1
    assert stranded.end(URL, "health check: no answer in 3 s") == 2
    assert stranded.end(URL, "again") == 0  # already ended: not cancelled twice
    await asyncio.gather(tasks["a"], tasks["b"], return_exceptions=True)
    assert endings == {"a": "health check: no answer in 3 s", "b": "health check: no answer in 3 s"}
    assert stranded.waiting_on(URL) == 0 and not tasks["c"].done()
    tasks["c"].cancel()
    await asyncio.gather(tasks["c"], return_exceptions=True)
    assert stranded.waiting_on("x") == 0


async def test_a_booking_says_how_its_request_ends() -> None:
    stranded = StrandedRequests()
    with stranded.book(URL, "solo") as booking:
        booking.ended = "health check: no answer in 3 s"
        outcome = booking.outcome()
    assert outcome.status == 503 and outcome.code == "upstream_unresponsive" and outcome.unreachable
    assert outcome.error is not None and f"'solo' at {URL} stopped answering (health check" in outcome.error


async def test_the_poll_tells_of_each_server_it_marks_down_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pool_health, "TIMEOUT_S", 0.05)
    async with FakeUpstream() as hung, FakeUpstream() as fine:
        hung.health_delay_s = 1.0
        table = UpstreamTable([Upstream("a", hung.url), Upstream("b", hung.url), Upstream("c", fine.url)])
        told: list[tuple[str, str]] = []
        timeouts: dict[str, int] = {}
        async with aiohttp.ClientSession() as client:
            for _ in range(3):
                await pool_health.poll_round(table, client, timeouts, on_down=lambda url, why: told.append((url, why)))
        assert told == [(hung.url, "health check: no answer in 0.05 s")]  # once for its two profiles, then down
        assert table.replica_down_reason("c") is None
