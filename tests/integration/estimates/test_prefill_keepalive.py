"""A streamed request whose server is silent while it prefills gets keep-alives from the proxy
(requests/forwarding/keepalive.py).

A silence of chosen length before the headers is a fault a real server cannot be made to produce on demand, so the
delays come from the in-process fake upstream; one test runs the keep-alives on a real llama-server as well."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import openai
import orjson
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

from adaptive_spec.llama.upstreams import Upstream, UpstreamTable
from adaptive_spec.proxy.app import ProxySettings, build_app
from adaptive_spec.requests.app_keys import HISTORY
from adaptive_spec.requests.forwarding.keepalive import ANTHROPIC_PING, CHAT_EMPTY_CHUNK
from tests.support.fakes.fake_upstream import CHUNK, FakeUpstream
from tests.support.processes.servers import LlamaServer, ProxyProcess, free_port
from tests.support.sse import events

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
MESSAGES = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "stream": True}
ANTHROPIC_STREAM = (
    b'event: message_start\ndata: {"type":"message_start","message":{"id":"m1","type":"message","role":"assistant",'
    b'"content":[],"model":"m","stop_reason":null,"usage":{"input_tokens":1,"output_tokens":0}}}\n\n'
    b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
)
DELAY_S = 1.0  # the fake server's "prefill"
INTERVAL_S = 0.2  # the proxy's keep-alive interval in these tests

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _slow_stream(delay_s: float, answer: bytes) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        await asyncio.sleep(delay_s)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(answer)
        await resp.write_eof()
        return resp

    return handle


def _headers_then_silence(delay_s: float, answer: bytes) -> Handler:
    """As llama-server b11549 streams: the 200 headers at once, then nothing until the prefill ends."""

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(delay_s)
        await resp.write(answer)
        await resp.write_eof()
        return resp

    return handle


def _headers_then_comments(delay_s: float, answer: bytes) -> Handler:
    """As llama-server b11549 streams a longer prefill: the headers at once, then an SSE comment (`:`, a blank line)
    after each stretch without a result (its `--sse-ping-interval`, 30 s): here one at once, then each quarter."""

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b":\n\n")
        for _ in range(4):
            await asyncio.sleep(delay_s / 4)
            await resp.write(b":\n\n")
        await resp.write(answer)
        await resp.write_eof()
        return resp

    return handle


def _error_after(delay_s: float) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        await asyncio.sleep(delay_s)
        body = {"error": {"code": 400, "message": "the request exceeds the available context size", "type": "x"}}
        return web.json_response(body, status=400)

    return handle


def _overflow_after(delay_s: float) -> Handler:
    """llama-server's answer to a prompt over its context, as it words it on any API, after `delay_s`."""

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        await asyncio.sleep(delay_s)
        message = "request (40000 tokens) exceeds the available context size (32768 tokens), try increasing it"
        error = {"code": 400, "message": message, "type": "exceed_context_size_error"}
        return web.json_response({"error": {**error, "n_prompt_tokens": 40000, "n_ctx": 32768}}, status=400)

    return handle


def _messages(delay_s: float) -> Handler:
    """/v1/messages: the stream, or the overflow for a body whose `max_tokens` is 40000."""
    stream, overflow = _slow_stream(delay_s, ANTHROPIC_STREAM), _overflow_after(delay_s)

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        return await (overflow if body.get("max_tokens") == 40000 else stream)(request)

    return handle


def _chat(delay_s: float) -> Handler:
    """/v1/chat/completions: headers with the first bytes (llama-server b11434), or at once for model "early", and
    with comments in the silence for model "pinging" (b11549)."""
    stream = CHUNK + CHUNK + b"data: [DONE]\n\n"
    late, early = _slow_stream(delay_s, stream), _headers_then_silence(delay_s, stream)
    pinging = _headers_then_comments(delay_s, stream)

    async def handle(request: web.Request) -> web.StreamResponse:
        model = (await request.json()).get("model")
        return await (early if model == "early" else pinging if model == "pinging" else late)(request)

    return handle


def _routes(delay_s: float) -> dict[tuple[str, str], Handler]:
    return {
        ("POST", "/v1/chat/completions"): _chat(delay_s),
        ("POST", "/v1/messages"): _messages(delay_s),
        ("POST", "/v1/completions"): _error_after(delay_s),
    }


Rig = Callable[[float, float], Awaitable[TestServer]]


@pytest_asyncio.fixture(loop_scope="function")
async def rig() -> AsyncIterator[Rig]:
    made: list[tuple[FakeUpstream, TestServer]] = []

    async def make(delay_s: float, interval_s: float) -> TestServer:
        fake = FakeUpstream(routes=_routes(delay_s))
        await fake.start()
        settings = ProxySettings(read_timeout_s=5.0, prefill_keepalive_s=interval_s)
        proxy = TestServer(build_app(UpstreamTable([Upstream("fake", fake.url)]), settings), port=free_port())
        await proxy.start_server()
        made.append((fake, proxy))
        return proxy

    yield make
    for fake, proxy in made:
        await proxy.close()
        await fake.close()


async def _post(proxy: TestServer, path: str, body: dict[str, Any]) -> tuple[int, list[tuple[float, bytes]]]:
    """The status and each piece of the answer with the time it arrived."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with aiohttp.ClientSession() as session, session.post(proxy.make_url(path), json=body) as resp:
        pieces = [(loop.time() - started, chunk) async for chunk in resp.content.iter_any()]
        return resp.status, pieces


@pytest.mark.asyncio(loop_scope="function")
async def test_a_silent_prefill_gets_keepalive_chunks_before_the_first_token(rig: Rig) -> None:
    proxy = await rig(DELAY_S, INTERVAL_S)
    status, pieces = await _post(proxy, "/v1/chat/completions", CHAT)
    assert status == 200
    body = b"".join(piece for _, piece in pieces)
    head, _, rest = body.partition(CHUNK)
    pings = head.count(CHAT_EMPTY_CHUNK)
    assert pings >= 3 and head == CHAT_EMPTY_CHUNK * pings  # keep-alives only, then the server's own stream
    assert rest == CHUNK + b"data: [DONE]\n\n"
    assert pieces[0][0] < DELAY_S / 2  # the client heard from the proxy long before the server answered
    record = proxy.app[HISTORY].latest(1)[0]
    assert record.outcome == "finished"


@pytest.mark.asyncio(loop_scope="function")
async def test_headers_at_once_then_a_silent_prefill_still_get_keepalives(rig: Rig) -> None:
    """The headers are no answer: the keep-alives go on until the stream's first bytes (Qwen Code's stream guard
    gave up at 240 s with them on, as llama-server b11549 sent its headers at once)."""
    proxy = await rig(DELAY_S, INTERVAL_S)
    status, pieces = await _post(proxy, "/v1/chat/completions", {**CHAT, "model": "early"})
    body = b"".join(piece for _, piece in pieces)
    head, _, rest = body.partition(CHUNK)
    pings = head.count(CHAT_EMPTY_CHUNK)
    assert status == 200 and pings >= 3 and head == CHAT_EMPTY_CHUNK * pings
    assert rest == CHUNK + b"data: [DONE]\n\n"
    assert proxy.app[HISTORY].latest(1)[0].outcome == "finished"


@pytest.mark.asyncio(loop_scope="function")
async def test_the_servers_comments_in_a_silent_prefill_do_not_end_the_keepalives(rig: Rig) -> None:
    """llama-server b11549's comments during a prefill are no answer: the keep-alive chunks go on past them until
    the first event, and the comments are dropped (Qwen Code's guard counts no comment: it gave a first turn up
    240 s after the server's first comment had ended the keep-alives)."""
    proxy = await rig(DELAY_S, INTERVAL_S)
    status, pieces = await _post(proxy, "/v1/chat/completions", {**CHAT, "model": "pinging"})
    body = b"".join(piece for _, piece in pieces)
    head, _, rest = body.partition(CHUNK)
    pings = head.count(CHAT_EMPTY_CHUNK)
    assert status == 200 and head == CHAT_EMPTY_CHUNK * pings, body  # keep-alives only: no comment passed
    assert pings >= 3, body  # all after the server's first comment, which came with its headers
    assert rest == CHUNK + b"data: [DONE]\n\n"


@pytest.mark.asyncio(loop_scope="function")
async def test_the_openai_sdk_reads_through_the_keepalives(rig: Rig) -> None:
    proxy = await rig(DELAY_S, INTERVAL_S)
    client = openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key="x", max_retries=0)
    chunks = [
        chunk
        async for chunk in await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True
        )
    ]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "toktok" and sum(1 for c in chunks if not c.choices) >= 3


@pytest.mark.asyncio(loop_scope="function")
async def test_anthropic_streams_get_ping_events(rig: Rig) -> None:
    proxy = await rig(DELAY_S, INTERVAL_S)
    status, pieces = await _post(proxy, "/v1/messages", MESSAGES)
    body = b"".join(piece for _, piece in pieces)
    assert status == 200 and body.startswith(ANTHROPIC_PING) and body.endswith(ANTHROPIC_STREAM)
    assert [e.event for e in events(body)][:3] == ["ping", "ping", "ping"]


@pytest.mark.asyncio(loop_scope="function")
async def test_a_quick_error_is_still_an_ordinary_4xx(rig: Rig) -> None:
    proxy = await rig(0.0, 0.5)
    status, pieces = await _post(proxy, "/v1/completions", {"model": "m", "prompt": "hi", "stream": True})
    assert status == 400
    assert "context size" in json.loads(b"".join(p for _, p in pieces))["error"]["message"]


@pytest.mark.asyncio(loop_scope="function")
async def test_an_error_after_the_keepalives_is_the_streams_error_event(rig: Rig) -> None:
    proxy = await rig(DELAY_S, INTERVAL_S)
    status, pieces = await _post(proxy, "/v1/completions", {"model": "m", "prompt": "hi", "stream": True})
    body = b"".join(piece for _, piece in pieces)
    assert status == 200 and body.startswith(b": keep-alive\n\n")
    error = orjson.loads(events(body)[-1].data)["error"]
    assert "answered 400" in error["message"] and "context size" in error["message"]
    record = proxy.app[HISTORY].latest(1)[0]
    assert record.outcome == "failed" and record.status == 400


@pytest.mark.asyncio(loop_scope="function")
async def test_an_overflow_after_pings_is_anthropics_error_event(rig: Rig) -> None:
    """On /v1/messages an overflow that comes after the keep-alives ends the stream in Anthropic's words, the ones
    Claude Code reads as an overflow (quicker, it is the ordinary 400: test_claude_code.py)."""
    proxy = await rig(DELAY_S, INTERVAL_S)
    status, pieces = await _post(proxy, "/v1/messages", {**MESSAGES, "max_tokens": 40000})
    body = b"".join(piece for _, piece in pieces)
    assert status == 200 and body.startswith(ANTHROPIC_PING)
    last = events(body)[-1]
    assert last.event == "error"
    assert orjson.loads(last.data) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "prompt is too long: 40000 tokens > 32768 maximum"},
    }
    record = proxy.app[HISTORY].latest(1)[0]
    assert record.outcome == "failed" and record.status == 400


@pytest.mark.asyncio(loop_scope="function")
async def test_zero_turns_them_off(rig: Rig) -> None:
    proxy = await rig(DELAY_S, 0.0)
    status, pieces = await _post(proxy, "/v1/chat/completions", CHAT)
    assert status == 200 and b"".join(p for _, p in pieces).startswith(CHUNK)
    assert pieces[0][0] >= DELAY_S * 0.9


def test_on_a_real_server_the_text_is_the_same_with_keepalives(tiny_server: LlamaServer) -> None:
    """Keep-alives every millisecond, so some go out before the real server's first chunk: the text is unchanged."""
    proxy = ProxyProcess("--profile", f"plain={tiny_server.url}", "--prefill-keepalive", "0.001")
    try:
        texts = []
        for base in (tiny_server.url + "/v1", proxy.base + "/v1"):
            client = openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=60)
            stream = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Say hi."}], stream=True, temperature=0, max_tokens=24
            )
            texts.append("".join(c.choices[0].delta.content or "" for c in stream if c.choices))
        assert texts[0] == texts[1] and texts[0]
    finally:
        proxy.stop()


def test_a_real_servers_silent_prefill_gets_keepalives(tiny_server: LlamaServer) -> None:
    """llama-server b11549 sends a stream's headers before it prefills: through the proxy, keep-alive chunks come
    first all the same, then the server's own stream, whole."""
    interval_s = 0.02
    proxy = ProxyProcess("--profile", f"plain={tiny_server.url}", "--prefill-keepalive", str(interval_s))
    words = " ".join(f"word{i}" for i in range(2000))  # a prompt no earlier test left in the slot's cache
    body = {**CHAT, "messages": [{"role": "user", "content": words}], "max_tokens": 4, "temperature": 0}
    request = urllib.request.Request(
        proxy.base + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            raw = resp.read()
    finally:
        proxy.stop()
    pings = 0
    while raw.startswith(CHAT_EMPTY_CHUNK, pings * len(CHAT_EMPTY_CHUNK)):
        pings += 1
    own = [json.loads(e.data) for e in events(raw[pings * len(CHAT_EMPTY_CHUNK) :]) if e.data != "[DONE]"]
    timings = next(c["timings"] for c in own if "timings" in c)
    assert timings["prompt_ms"] > 10 * interval_s * 1000, timings  # the prefill outlasted several intervals
    assert pings >= 1, raw[:300]
    assert own[0]["choices"][0]["delta"].get("role") == "assistant" and raw.endswith(b"data: [DONE]\n\n")
    assert CHAT_EMPTY_CHUNK not in raw[pings * len(CHAT_EMPTY_CHUNK) :]  # none once the server's stream began
