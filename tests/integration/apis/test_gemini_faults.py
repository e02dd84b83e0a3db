"""Gemini streams through the proxy when their server fails them, with the in-process fake upstream (faults a real
llama-server cannot be made to show on demand): a stream broken off or stalled ends with an error in Google's shape (the
JSON array still one whole value), one that ends without `[DONE]` still ends with a finish reason, and a silent prefill
gets SSE comments (which Gemini's SDK skips) while the JSON array gets none."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from adaptive_spec.llama.upstreams import Upstream, UpstreamTable
from adaptive_spec.proxy.app import ProxySettings, build_app
from adaptive_spec.requests.app_keys import HISTORY
from tests.support.fakes.fake_upstream import CHUNK, FakeUpstream
from tests.support.gemini import sse_chunks, text_of
from tests.support.processes.servers import free_port

PRO = "gemini-3.1-pro-preview"
BODY = {
    "contents": [{"role": "user", "parts": [{"text": "Name three colours."}]}],
    "generationConfig": {"maxOutputTokens": 8},
}


async def _silent_then_streams(request: web.Request) -> web.StreamResponse:
    """A server silent for a second (a long prefill), then two chunks and the end."""
    await request.read()
    await asyncio.sleep(1.0)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(CHUNK + CHUNK + b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _faulted(fault: str, query: str, keepalive_s: float = 0.0) -> tuple[int, bytes, Any]:
    """A Gemini stream whose server (the in-process fake: a fault a real one cannot be made to show) fails as told:
    `x-fault` (tests/support/fakes/fake_upstream.py), or "silent" for a second before it answers."""
    routes = {("POST", "/v1/chat/completions"): _silent_then_streams} if fault == "silent" else {}
    async with FakeUpstream(routes=routes) as fake:
        settings = ProxySettings(read_timeout_s=5.0 if keepalive_s else 0.5, prefill_keepalive_s=keepalive_s)
        app = build_app(UpstreamTable([Upstream("fake", fake.url)]), settings)
        server = TestServer(app, port=free_port())
        await server.start_server()
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    server.make_url(f"/v1beta/models/{PRO}:streamGenerateContent{query}"),
                    json=BODY,
                    headers={"x-fault": fault},
                ) as resp,
            ):
                data = await resp.read()
            return resp.status, data, app[HISTORY].latest(1)[0]
        finally:
            await server.close()


@pytest.mark.asyncio(loop_scope="function")
@pytest.mark.parametrize(
    ("fault", "query", "code", "status"),
    [
        ("drop", "?alt=sse", 500, "INTERNAL"),
        ("drop", "", 500, "INTERNAL"),
        ("stall", "?alt=sse", 504, "DEADLINE_EXCEEDED"),
        ("stall", "", 504, "DEADLINE_EXCEEDED"),
    ],
)
async def test_a_stream_its_server_breaks_off_ends_with_googles_error(
    fault: str, query: str, code: int, status: str
) -> None:
    got, data, record = await _faulted(fault, query)
    chunks = sse_chunks(data) if query else json.loads(data)  # the array is still one whole JSON value
    assert got == 200 and text_of(chunks[:-1]) == "toktok"
    assert (chunks[-1]["error"]["code"], chunks[-1]["error"]["status"]) == (code, status)
    assert record.outcome == "failed" and record.api == "gemini"


@pytest.mark.asyncio(loop_scope="function")
async def test_a_stream_that_ends_without_done_still_ends_with_a_finish_reason() -> None:
    got, data, _ = await _faulted("", "?alt=sse")  # the fake's two events, then the end without [DONE]
    chunks = sse_chunks(data)
    assert got == 200 and text_of(chunks) == "toktok" and chunks[-1]["candidates"][0]["finishReason"] == "STOP"


@pytest.mark.asyncio(loop_scope="function")
async def test_a_silent_prefill_gets_sse_comments_and_the_array_stream_none() -> None:
    got, data, record = await _faulted("silent", "?alt=sse", 0.2)
    assert got == 200 and data.startswith(b": keep-alive\n\n") and data.count(b": keep-alive\n\n") >= 3
    chunks = sse_chunks(data, keepalives=True)
    assert text_of(chunks) == "toktok" and chunks[-1]["candidates"][0]["finishReason"] == "STOP"
    assert record.outcome == "finished"
    got, data, _ = await _faulted("silent", "", 0.2)
    assert got == 200 and data.startswith(b"[") and text_of(json.loads(data)) == "toktok"
