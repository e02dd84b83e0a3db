"""The one in-process fake upstream, for faults only: what a real llama-server (or the real kv-relay) cannot be made
to do on demand. Everything a real server can show is tested against one (tests/conftest.py `tiny_server`).

Streamed faults, chosen per request by its `x-fault` header, on any path not given in `routes` (all but the two
marked "before" send two CHUNK events first):

    drop                      the connection closed mid-stream (no end, no [DONE])
    stall                     silence for 30 s once the headers are sent
    stall-before-headers      silence for 30 s before any header ("before")
    malformed                 an event that is not JSON, a comment, then the stream cut in the middle of an event
    truncated-late            five more events over 50 ms, then cut in the middle of an event
    done                      [DONE]: a whole, well-formed stream
    endless                   an event every 50 ms for 30 s; a client that goes away must cancel it (`cancelled`)
    close-before-answer-once  the first such request's connection closed before any answer, as a server closing a
                              kept-alive connection looks to the client ("before")
    drop-reused-connections   each connection answered once, then closed unanswered when it is used again

Without the header: the two events, then the end of the stream without [DONE].

Set on the instance:

    answer, piece_bytes       every streamed answer is exactly `answer`, written in pieces of `piece_bytes` bytes, so
                              every field, line end and event is split somewhere
    headers                   added to every streamed answer
    health_delay_s            GET /health (llama-server's recorded answer) comes that late; `health_asked` counts
    routes                    handlers of one test by (method, path), for a fault of its own: a /tokenize that splits
                              text unlike the GGUF on this machine, a slot saved after another request took it, a
                              kv-relay that lies about its file
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from types import TracebackType

from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.support.processes.servers import free_port
from tests.support.recorded import recorded

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
CHUNK = b'data: {"choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n'


class FakeUpstream:
    def __init__(
        self,
        *,
        answer: bytes | None = None,
        piece_bytes: int = 0,
        headers: Mapping[str, str] | None = None,
        routes: Mapping[tuple[str, str], Handler] | None = None,
    ) -> None:
        self.answer, self.piece_bytes = answer, piece_bytes
        self.headers = {"Content-Type": "text/event-stream", **(headers or {})}
        self.routes = dict(routes or {})
        self.health_delay_s = 0.0
        self.health_asked = 0
        self.cancelled = asyncio.Event()  # a streamed answer was cancelled: its client went away
        self.dropped_once = False
        self._transports: set[int] = set()
        self._server: TestServer | None = None

    @property
    def url(self) -> str:
        assert self._server is not None and self._server.port is not None, "start() it first"
        return f"http://127.0.0.1:{self._server.port}"

    async def start(self) -> str:
        app = web.Application()
        for (method, path), handler in self.routes.items():
            app.router.add_route(method, path, handler)
        if ("GET", "/health") not in self.routes:
            app.router.add_get("/health", self._health)
        app.router.add_route("*", "/{tail:.*}", self._stream)
        self._server = TestServer(app, host="127.0.0.1", port=free_port())
        await self._server.start_server()
        return self.url

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()

    async def __aenter__(self) -> FakeUpstream:
        await self.start()
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def _health(self, _request: web.Request) -> web.Response:
        self.health_asked += 1
        if self.health_delay_s:
            await asyncio.sleep(self.health_delay_s)
        return web.json_response(recorded("health"))

    async def _before_headers(self, request: web.Request, fault: str) -> None:
        if fault == "close-before-answer-once" and not self.dropped_once:
            self.dropped_once = True
            assert request.transport is not None
            request.transport.close()
            await asyncio.sleep(1)
        if fault == "drop-reused-connections":
            assert request.transport is not None
            if id(request.transport) in self._transports:
                request.transport.close()
                await asyncio.sleep(1)
            self._transports.add(id(request.transport))
            await asyncio.sleep(0.2)  # concurrent requests need connections of their own
        if fault == "stall-before-headers":
            await asyncio.sleep(30)

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        fault = request.headers.get("x-fault", "")
        await self._before_headers(request, fault)
        resp = web.StreamResponse(headers=self.headers)
        await resp.prepare(request)
        try:
            if self.answer is not None:
                await self._pieces(resp, self.answer)
            else:
                await resp.write(CHUNK + CHUNK)
                await self._after_two_events(request, resp, fault)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return resp

    async def _pieces(self, resp: web.StreamResponse, answer: bytes) -> None:
        step = self.piece_bytes or len(answer)
        for start in range(0, len(answer), step):
            await resp.write(answer[start : start + step])
            if start % (1000 * step) == 0:
                await asyncio.sleep(0)

    async def _after_two_events(self, request: web.Request, resp: web.StreamResponse, fault: str) -> None:
        if fault == "drop":
            assert request.transport is not None
            request.transport.close()
        elif fault == "stall":
            await asyncio.sleep(30)
        elif fault == "malformed":
            await resp.write(b'data: {not json}\n\n: comment\ndata: {"choices": [{"delta": {"content": "x')
        elif fault == "truncated-late":  # after the relay passes chunks on as they come: cut mid-event
            for _ in range(5):
                await asyncio.sleep(0.01)
                await resp.write(CHUNK)
            await resp.write(b'data: {"choices": [{"delta": {"content": "x')
        elif fault == "done":
            await resp.write(b"data: [DONE]\n\n")
        elif fault == "endless":
            for _ in range(600):
                await asyncio.sleep(0.05)
                await resp.write(CHUNK)
