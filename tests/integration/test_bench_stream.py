"""The bench's stream reader (the proxy's SSE parser) under what a real llama-server does not send on demand: events
split across chunks at every awkward place, CRLF line ends, comments, and a 100,000-character line."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from adaptive_spec.bench.stream import stream_chat
from tests.support.servers import free_port

pytestmark = pytest.mark.asyncio(loop_scope="function")
LONG = "x" * 100_000


def _event(obj: object, end: bytes = b"\n\n") -> bytes:
    return b"data: " + orjson.dumps(obj) + end


async def _handle(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-adaptive-spec-profile": "p"})
    await resp.prepare(request)
    body = (
        _event({"choices": [{"delta": {"content": "Hel"}}]}, b"\r\n\r\n")
        + _event({"choices": [{"delta": {"content": LONG}}]})
        + b": a comment\n\n"
        + _event({"choices": [{"delta": {}, "finish_reason": "stop"}], "timings": {"predicted_n": 2}})
        + b"data: [DONE]\n\n"
    )
    for start in range(0, len(body), 7):  # 7-byte chunks: every field, line end and event is split somewhere
        await resp.write(body[start : start + 7])
        if start % 7000 == 0:
            await asyncio.sleep(0)
    return resp


async def test_the_reader_takes_any_split_crlf_and_long_lines() -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _handle)
    server = TestServer(app, port=free_port())
    await server.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            reply = await stream_chat(session, str(server.make_url("/v1/chat/completions")), {"stream": True})
    finally:
        await server.close()
    assert reply.text == "Hel" + LONG
    assert reply.timings == {"predicted_n": 2} and reply.finish_reason == "stop"
    assert reply.served_profile == "p" and reply.route is None
    assert reply.ttft_ms is not None and reply.ttst_ms is not None and reply.ttst_ms >= reply.ttft_ms
