"""A request not seen to its end is counted from llama-server's counters even when the next request through the
proxy was forwarded before a quiet reading and outlasts the settle window: a client's retry of the request it gave
up on (mini-swe-agent's litellm after a timeout, on a loaded machine where `/metrics` did not answer in time). The
retry's own answer says its counts, so the quiet moment after it settles the one before.

The ledger's shell (requests/accounting.py) against a real llama-server (the tiny model); the requests go to it
straight, and the shell is told of them as the forward tells it."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from adaptive_spec.requests.accounting import Accounting, counts_of
from adaptive_spec.streams.timings import parse_timings
from adaptive_spec.telemetry.ledger import Counts, from_metrics
from adaptive_spec.telemetry.records import Timings
from tests.integration.apis.test_counts import ENDLESS
from tests.support.processes.servers import LlamaServer, wait_until

pytestmark = pytest.mark.asyncio(loop_scope="function")

SETTLE_S = 0.1  # the window a busy server is polled for; the retry below lasts several times longer


async def _counters(client: aiohttp.ClientSession, url: str) -> Counts:
    async with client.get(url + "/metrics") as resp:
        text = await resp.text()
    values = {}
    for line in text.splitlines():
        if line.startswith("llamacpp:") and " " in line:
            name, value = line.split()
            values[name] = float(value)
    counters = from_metrics(values)
    assert counters is not None, text[:400]
    return counters


async def _answer(client: aiohttp.ClientSession, url: str, content: str, max_tokens: int) -> Timings:
    body = {
        "model": "m",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": content}],
    }
    async with client.post(url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        answer = json.loads(await resp.text())
    timings = parse_timings(answer["timings"])
    assert timings is not None
    return timings


async def _hang_up(client: aiohttp.ClientSession, url: str) -> None:
    """A streamed answer left after its first chunks, while llama-server is still decoding it."""
    async with client.post(url + "/v1/chat/completions", json=ENDLESS) as resp:
        assert resp.status == 200
        chunks = 0
        async for line in resp.content:
            chunks += line.startswith(b"data: ")
            if chunks >= 40:
                break
        resp.close()  # the client hangs up


async def test_a_request_given_up_is_counted_after_a_retry_that_outlasts_the_settle_window(
    tiny_server: LlamaServer,
) -> None:
    url = tiny_server.url
    wait_until(lambda: not tiny_server.slot_busy(), 60, "llama-server to be idle")
    accounting = Accounting(settle_s=SETTLE_S)
    async with aiohttp.ClientSession() as client:
        await accounting.before_forward(client, url)  # the baseline, before the first forward
        accounting.forwarded(url)
        first = await _answer(client, url, "Say hi.", 4)
        assert accounting.ended(client, url, "first", counts_of(first, True)) is None
        wait_until(lambda: not tiny_server.slot_busy(), 60, "llama-server to be idle")
        await asyncio.sleep(0.5)  # the reading the first answer started
        before = await _counters(client, url)

        accounting.forwarded(url)
        await _hang_up(client, url)
        waiting = accounting.ended(client, url, "given-up", None)
        assert waiting is not None  # not seen to its end: it waits for the counters

        # The retry is forwarded before any quiet reading (its `before_forward` reading did not come in time: a
        # loaded server's /metrics), and lasts well past the settle window.
        accounting.forwarded(url)
        began = time.monotonic()
        retry = await _answer(client, url, "Say hi again, at length.", 3000)
        lasted = time.monotonic() - began
        assert lasted > 3 * SETTLE_S, f"the retry lasted {lasted:.2f} s: not past the settle window"
        assert not waiting.done(), waiting.result()  # still waiting, not given up while the retry ran
        assert accounting.ended(client, url, "retry", counts_of(retry, True)) is None

        counted = await asyncio.wait_for(waiting, 30)
        after = await _counters(client, url)
        await accounting.close()

    assert counted is not None, "the request given up was not told apart from its retry"
    own = counts_of(retry, True)
    assert own is not None
    expected = after - before - own
    assert counted.tokens() == expected.tokens(), (counted, expected)
    assert counted.predicted_n >= 39, counted  # at least the tokens its client read
