"""Faults a real llama-server cannot be made to produce on demand, injected by an in-process fake upstream."""

from __future__ import annotations

import asyncio
import contextlib
import logging
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
from adaptive_spec.requests.app_keys import HISTORY, LIFECYCLE, UPSTREAMS
from adaptive_spec.requests.error_responses import RETRY_AFTER_S
from adaptive_spec.requests.forwarding.stranded import STRANDED
from tests.support.fakes.fake_upstream import CHUNK, FakeUpstream
from tests.support.processes.servers import free_port
from tests.support.sse import events
from tests.support.waiting import until

pytestmark = pytest.mark.asyncio(loop_scope="function")


@pytest_asyncio.fixture(loop_scope="function")
async def rig() -> AsyncIterator[tuple[FakeUpstream, TestServer, str]]:
    async with FakeUpstream() as fake:
        dead_url = f"http://127.0.0.1:{free_port()}"
        table = UpstreamTable([Upstream("fake", fake.url), Upstream("dead", dead_url)])
        proxy = TestServer(build_app(table, ProxySettings(read_timeout_s=0.5)), port=free_port())
        await proxy.start_server()
        yield fake, proxy, dead_url
        await proxy.close()


BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})


async def _post(proxy: TestServer, headers: dict[str, str]) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(proxy.make_url("/v1/chat/completions"), data=BODY, headers=headers) as resp,
    ):
        return resp.status, await resp.read()


def _last_record(proxy: TestServer) -> Any:
    return proxy.app[HISTORY].latest(1)[0]


async def _error_event(body: bytes) -> dict[str, Any]:
    last = events(body)[-1]
    assert last.data, body
    error: dict[str, Any] = orjson.loads(last.data)["error"]
    return error


async def test_upstream_drops_mid_stream(rig: tuple[FakeUpstream, TestServer, str]) -> None:
    _, proxy, _ = rig
    status, body = await asyncio.wait_for(_post(proxy, {"x-fault": "drop"}), 10)
    assert status == 200
    assert body.startswith(CHUNK + CHUNK)
    error = await _error_event(body)
    assert error["code"] == "upstream_disconnected" and "'fake'" in error["message"]
    record = _last_record(proxy)
    assert record.outcome == "failed" and "closed the stream" in (record.error or "")
    assert record.ttft_ms is not None and record.ttst_ms is not None


async def test_openai_sdk_raises_on_the_error_event(rig: tuple[FakeUpstream, TestServer, str]) -> None:
    _, proxy, _ = rig
    client = openai.AsyncOpenAI(base_url=str(proxy.make_url("/v1")), api_key="x", max_retries=0)
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}], stream=True, extra_headers={"x-fault": "drop"}
    )
    pieces: list[str] = []
    with pytest.raises(openai.APIError, match="closed the stream before it ended"):
        async for chunk in stream:
            pieces.append(chunk.choices[0].delta.content or "")
    assert pieces == ["tok", "tok"]
    await client.close()


async def test_upstream_stalls_after_headers(rig: tuple[FakeUpstream, TestServer, str]) -> None:
    _, proxy, _ = rig
    status, body = await asyncio.wait_for(_post(proxy, {"x-fault": "stall"}), 10)
    assert status == 200
    assert (await _error_event(body))["code"] == "upstream_timeout"


async def test_upstream_stalls_before_headers(rig: tuple[FakeUpstream, TestServer, str]) -> None:
    _, proxy, _ = rig
    status, body = await asyncio.wait_for(_post(proxy, {"x-fault": "stall-before-headers"}), 10)
    assert status == 504
    assert orjson.loads(body)["error"]["code"] == "upstream_timeout"
    assert _last_record(proxy).status == 504


async def test_malformed_and_truncated_sse(rig: tuple[FakeUpstream, TestServer, str]) -> None:
    _, proxy, _ = rig
    status, body = await asyncio.wait_for(_post(proxy, {"x-fault": "malformed"}), 10)
    assert status == 200
    assert b"data: {not json}" in body  # passed through untouched
    assert (await _error_event(body))["code"] == "upstream_truncated"


async def test_a_stream_cut_mid_event_late_in_the_answer_is_told(rig: tuple[FakeUpstream, TestServer, str]) -> None:
    """Cut after the relay began to pass chunks on without reading them: still an error event, and a failed record."""
    _, proxy, _ = rig
    status, body = await asyncio.wait_for(_post(proxy, {"x-fault": "truncated-late"}), 10)
    assert status == 200
    assert body.count(CHUNK) == 7  # every whole event went out as it came
    assert (await _error_event(body))["code"] == "upstream_truncated"
    record = _last_record(proxy)
    assert record.outcome == "failed" and "middle of an event" in (record.error or "")


async def test_unreachable_profile_is_503_naming_it_and_when_to_retry(
    rig: tuple[FakeUpstream, TestServer, str],
) -> None:
    """A refused connection (a crashed server, before anyone noticed) is not a bad gateway: 503 with Retry-After,
    and the profile is marked down there and then, so the next request is refused without trying it."""
    _, proxy, dead_url = rig
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            proxy.make_url("/v1/chat/completions"), data=BODY, headers={"x-adaptive-spec-profile": "dead"}
        ) as resp,
    ):
        status, body, retry_after = resp.status, await resp.read(), resp.headers.get("Retry-After")
    assert status == 503 and retry_after == str(RETRY_AFTER_S)
    error = orjson.loads(body)["error"]
    assert error["code"] == "upstream_unreachable"
    assert "'dead'" in error["message"] and dead_url in error["message"]
    assert proxy.app[UPSTREAMS].replica_down_reason("dead") == "refused connections"
    status, body = await _post(proxy, {"x-adaptive-spec-profile": "dead"})
    assert status == 503 and orjson.loads(body)["error"]["code"] == "profile_unavailable", body


MESSAGES = orjson.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})


async def test_requests_waiting_on_a_server_that_stopped_answering_are_ended(
    rig: tuple[FakeUpstream, TestServer, str],
) -> None:
    """What the health poll does once it finds a server hung (requests/forwarding/stranded.py), on the fake upstream: a
    stream past its headers ends with its API's error event, requests not yet answered get a 503 in their API's shape
    with Retry-After, each record says why, and nothing waits for the read timeout (60 s here)."""
    fake, _, _ = rig
    table = UpstreamTable([Upstream("fake", fake.url)])
    proxy = TestServer(build_app(table, ProxySettings(read_timeout_s=60, prefill_keepalive_s=0)), port=free_port())
    await proxy.start_server()
    try:
        async with aiohttp.ClientSession() as session:
            url = proxy.make_url
            streaming = await session.post(url("/v1/chat/completions"), data=BODY, headers={"x-fault": "stall"})
            assert await streaming.content.readany()
            stalled = {"x-fault": "stall-before-headers"}
            chat = asyncio.create_task(session.post(url("/v1/chat/completions"), data=BODY, headers=stalled))
            messages = asyncio.create_task(session.post(url("/v1/messages"), data=MESSAGES, headers=stalled))
            await until(lambda: proxy.app[STRANDED].waiting_on(fake.url) == 3, "three requests on the server", 10)
            assert proxy.app[STRANDED].end(fake.url, "health check: no answer in 3 s") == 3
            tail = await asyncio.wait_for(streaming.read(), 5)
            chat_resp, messages_resp = await asyncio.wait_for(asyncio.gather(chat, messages), 5)
            chat_body, messages_body = await chat_resp.read(), await messages_resp.read()
        error = await _error_event(tail)
        assert error["code"] == "upstream_unresponsive" and "stopped answering" in error["message"], error
        assert chat_resp.status == 503 and chat_resp.headers["Retry-After"] == str(RETRY_AFTER_S)
        assert orjson.loads(chat_body)["error"]["code"] == "upstream_unresponsive", chat_body
        anthropic = orjson.loads(messages_body)
        assert messages_resp.status == 503 and anthropic["type"] == "error", anthropic
        assert anthropic["error"]["type"] == "api_error" and "stopped answering" in anthropic["error"]["message"]
        records = proxy.app[HISTORY].latest(3)
        assert sorted(r.status for r in records) == [200, 503, 503]
        assert all(r.outcome == "failed" and "no answer in 3 s" in (r.error or "") for r in records), records
        assert proxy.app[STRANDED].waiting_on(fake.url) == 0
        assert proxy.app[UPSTREAMS].replica_down_reason("fake") == "stopped answering"  # until the watch finds it
    finally:
        await proxy.close()


async def test_client_disconnect_cancels_upstream_at_once(rig: tuple[FakeUpstream, TestServer, str]) -> None:
    fake, proxy, _ = rig
    async with aiohttp.ClientSession() as session:
        resp = await session.post(proxy.make_url("/v1/chat/completions"), data=BODY, headers={"x-fault": "endless"})
        assert await resp.content.readany()
        resp.close()
    await asyncio.wait_for(fake.cancelled.wait(), 2)
    await asyncio.sleep(0.05)
    record = _last_record(proxy)
    assert record.status == 499 and record.outcome == "failed"


async def test_a_connection_dropped_before_any_answer_is_sent_again(rig: tuple[FakeUpstream, TestServer, str]) -> None:
    fake, proxy, _ = rig
    status, body = await asyncio.wait_for(_post(proxy, {"x-fault": "close-before-answer-once"}), 10)
    assert fake.dropped_once and status == 200 and body.startswith(CHUNK + CHUNK)


async def test_a_request_is_sent_again_on_a_new_connection_when_pooled_ones_are_dead(
    rig: tuple[FakeUpstream, TestServer, str],
) -> None:
    # Regression: under load llama-server dropped several pooled connections at once; the one retry took another
    # dead one from the pool and the client got 502 "Can not write request body".
    _, proxy, _ = rig
    headers = {"x-fault": "drop-reused-connections"}
    first = await asyncio.gather(*(_post(proxy, headers) for _ in range(3)))  # three connections in the pool
    assert [status for status, _ in first] == [200, 200, 200]
    status, body = await asyncio.wait_for(_post(proxy, headers), 10)
    assert status == 200 and body.startswith(CHUNK + CHUNK), body


async def test_requests_still_running_after_the_shutdown_grace_are_told(
    rig: tuple[FakeUpstream, TestServer, str],
) -> None:
    # Before: aiohttp waited 60 s, then cut the streams off without a word, and they were recorded as disconnects.
    fake, upstream_proxy, _ = rig
    upstream_url = upstream_proxy.app[UPSTREAMS].get("fake")
    assert upstream_url is not None
    settings = ProxySettings(read_timeout_s=60, shutdown_grace_s=0.3)
    proxy = TestServer(build_app(UpstreamTable([upstream_url]), settings), port=free_port())
    await proxy.start_server()
    async with aiohttp.ClientSession() as session:
        streaming = await session.post(
            proxy.make_url("/v1/chat/completions"), data=BODY, headers={"x-fault": "endless"}
        )
        assert await streaming.content.readany()
        waiting = asyncio.create_task(_post(proxy, {"x-fault": "stall-before-headers"}))
        await until(lambda: len(proxy.app[LIFECYCLE].handlers) == 2, "both requests being handled", 10)
        closing = asyncio.create_task(proxy.close())  # the shutdown
        tail = await asyncio.wait_for(streaming.read(), 10)
        status, body = await asyncio.wait_for(waiting, 10)
        await closing
    assert (await _error_event(tail))["code"] == "proxy_shutting_down"
    assert status == 503 and orjson.loads(body)["error"]["code"] == "proxy_shutting_down"
    records = proxy.app[HISTORY].latest(2)
    assert sorted(r.status for r in records) == [200, 503]
    assert all(r.outcome == "failed" and "shutting down" in (r.error or "") for r in records)
    assert fake.cancelled.is_set()  # the upstream request was ended too


DONE_BODY = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})


@pytest.mark.parametrize("where", ["write_eof", "write"])
async def test_a_client_gone_while_the_proxy_writes_is_a_disconnect_not_a_traceback(
    rig: tuple[FakeUpstream, TestServer, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    where: str,
) -> None:
    """What aiohttp raises when the client closed its socket just before the proxy writes (seen with real agents
    right after `[DONE]`): ClientConnectionResetError from the write, before the handler is cancelled."""
    _, proxy, _ = rig
    original = getattr(web.StreamResponse, where)

    async def closing(self: web.StreamResponse, data: bytes = b"") -> None:
        if "x-adaptive-spec-profile" in self.headers:  # the proxy's answer, not the fake upstream's
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
        await original(self, data)

    monkeypatch.setattr(web.StreamResponse, where, closing)
    fault = "done" if where == "write_eof" else "endless"
    caplog.set_level(logging.DEBUG)
    async with aiohttp.ClientSession() as session:
        resp = await session.post(proxy.make_url("/v1/chat/completions"), data=DONE_BODY, headers={"x-fault": fault})
        with contextlib.suppress(aiohttp.ClientError):
            await resp.read()
    await asyncio.sleep(0.1)
    record = _last_record(proxy)
    if where == "write_eof":  # everything up to [DONE] was written: the client lost nothing
        assert record.status == 200 and record.outcome == "finished" and record.error is None
    else:
        assert record.status == 499 and record.error == "the client disconnected"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    assert any("client" in r.getMessage() and record.request_id in r.getMessage() for r in caplog.records)


async def _quick_replica() -> web.AppRunner:
    """A replica that answers every stream at once (the fake upstream's faults are per request, so both of a pool's
    replicas would stall the same request)."""

    async def answer(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(CHUNK + b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    return runner


@pytest.mark.parametrize("keepalive_s", [0, 0.2], ids=["before-headers", "after-keep-alives"])
async def test_a_request_on_a_replica_that_stopped_answering_fails_over(
    rig: tuple[FakeUpstream, TestServer, str], keepalive_s: float
) -> None:
    """Nothing but keep-alives went out: the request ended on the hung replica is sent to the other one, and the
    client gets that one's whole answer."""
    fake, _, _ = rig
    runner = await _quick_replica()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    table = UpstreamTable([Upstream("pool", fake.url), Upstream("pool", f"http://127.0.0.1:{port}")])
    settings = ProxySettings(read_timeout_s=60, prefill_keepalive_s=keepalive_s)
    proxy = TestServer(build_app(table, settings), port=free_port())
    await proxy.start_server()
    try:
        posting = asyncio.create_task(_post(proxy, {"x-fault": "stall-before-headers"}))
        await until(lambda: proxy.app[STRANDED].waiting_on(fake.url) == 1, "the request on replica 0", 10)
        await asyncio.sleep(keepalive_s * 2)  # keep-alives out (if any)
        proxy.app[STRANDED].end(fake.url, "health check: no answer in 3 s")
        status, body = await asyncio.wait_for(posting, 10)
        assert status == 200 and body.endswith(CHUNK + b"data: [DONE]\n\n"), body
        assert (b"data: {" in body.split(CHUNK)[0]) is (keepalive_s > 0), body  # the keep-alive chunks before it
        record = _last_record(proxy)
        assert record.outcome == "finished" and record.replica == 1, record
        assert table.replica_down_reason("pool", 0) == "stopped answering"
    finally:
        await proxy.close()
        await runner.cleanup()


def _error_headers_then_silence(answered: asyncio.Event) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A server that hangs once it sent an error's headers: a 400 whose promised body never comes, after `x-late`
    seconds (past the keep-alive interval when the test wants keep-alives out first)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(float(request.headers.get("x-late", "0")))
        resp = web.StreamResponse(status=400, headers={"Content-Type": "application/json"})
        resp.content_length = 1000
        await resp.prepare(request)
        answered.set()
        await asyncio.sleep(30)
        return resp

    return handler


@pytest.mark.parametrize("where", ["error-body", "error-body-after-keep-alives", "answer-headers"])
async def test_a_request_ended_wherever_it_waits_is_told_not_dropped(
    monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """The health poll ends a request on a hung server (requests/forwarding/stranded.py) wherever the request's task is:
    reading the body of an error the server began to answer, the same once keep-alives went out, writing the headers of
    the server's answer to the client. The client is told (a 503, or its stream's error event), never left with a
    dropped connection, and the record says why."""
    answered, writing = asyncio.Event(), asyncio.Event()
    original = web.StreamResponse.prepare

    async def stalled(self: web.StreamResponse, request: web.BaseRequest) -> Any:
        if "x-adaptive-spec-profile" in self.headers and not writing.is_set():  # the proxy's answer, once
            writing.set()
            await asyncio.sleep(30)
        return await original(self, request)

    if where == "answer-headers":
        monkeypatch.setattr(web.StreamResponse, "prepare", stalled)
    routes = (
        {} if where == "answer-headers" else {("POST", "/v1/chat/completions"): _error_headers_then_silence(answered)}
    )
    keepalive_s = 0.2 if where == "error-body-after-keep-alives" else 0
    async with FakeUpstream(routes=routes) as fake:
        table = UpstreamTable([Upstream("fake", fake.url)])
        settings = ProxySettings(read_timeout_s=60, prefill_keepalive_s=keepalive_s)
        proxy = TestServer(build_app(table, settings), port=free_port())
        await proxy.start_server()
        try:
            headers = {"x-fault": "done", "x-late": "1" if keepalive_s else "0"}
            posting = asyncio.create_task(_post(proxy, headers))
            await asyncio.wait_for((writing if where == "answer-headers" else answered).wait(), 10)
            await asyncio.sleep(0.3)  # the server's headers reach the proxy, which reads on
            assert proxy.app[STRANDED].end(fake.url, "health check: no answer in 3 s") == 1
            status, body = await asyncio.wait_for(posting, 10)
            record = _last_record(proxy)
        finally:
            await proxy.close()
    if keepalive_s:
        assert status == 200 and body.startswith(b'data: {"id":"keep-alive"'), body
        error = await _error_event(body)
    else:
        assert status == 503, body
        error = orjson.loads(body)["error"]
    assert error["code"] == "upstream_unresponsive" and "stopped answering" in error["message"], error
    assert record.outcome == "failed" and "no answer in 3 s" in (record.error or ""), record
