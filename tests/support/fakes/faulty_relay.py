"""A fault injected in front of a REAL kv-relay, for what the real one cannot be made to do on demand: an HTTP proxy
on its own event loop (synchronous tests can hold it) that passes every request to the relay behind it untouched,
except the slot-file requests named by `fault`:

    stall              GET: the real file's headers and its first 64 KiB, then nothing (until the caller hangs up)
    reset              GET: the real file's headers and its first 64 KiB, then the connection reset (RST)
    html               GET: 200 with an HTML page (another service on the port, a captive portal), no checksum
    not-a-slot-file    GET: random bytes as long as the real file, with their own (matching) sha256
    garbage-answer     PUT: the upload passed on to the real relay (the file lands there), its answer replaced by
                       `201 text/html` that is not JSON

The real relay saves, hashes, receives, renames and deletes as it always does: only what crosses this wire changes.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import struct
import threading
from collections.abc import Coroutine
from typing import Any

import aiohttp
from aiohttp import web

from adaptive_spec.kv.slot_files import SHA256_HEADER
from tests.support.fakes.fake_upstream import FakeUpstream, Handler

_CHUNK = 64 << 10
_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}
_RELAY_ROUTES = [
    ("GET", "/relay/model"),
    ("GET", "/relay/probe"),
    ("POST", "/relay/prefill"),
    ("GET", "/relay/slots/{name}"),
    ("PUT", "/relay/slots/{name}"),
    ("DELETE", "/relay/slots/{name}"),
]


class FaultyRelay:
    """The one fake upstream (`FakeUpstream`, its routes all this class's) on an event loop of its own."""

    def __init__(self, relay_base: str) -> None:
        self.relay_base = relay_base.rstrip("/")
        self.fault = ""  # one of the module docstring's, or "" to pass everything on
        self.faulted: list[str] = []  # "METHOD path" of each request answered with the fault
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._client: aiohttp.ClientSession | None = None
        routes: dict[tuple[str, str], Handler] = {route: self._handle for route in _RELAY_ROUTES}
        self._server = FakeUpstream(routes=routes)
        self._run(self._start())
        self.base = self._server.url
        self.port = int(self.base.rsplit(":", 1)[1])

    def _run(self, work: Coroutine[Any, Any, None]) -> None:
        asyncio.run_coroutine_threadsafe(work, self._loop).result(60)

    async def _start(self) -> None:
        self._client = aiohttp.ClientSession(auto_decompress=False)
        await self._server.start()

    async def _stop(self) -> None:
        await self._server.close()
        if self._client is not None:
            await self._client.close()

    def stop(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self._stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            self._loop.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        slot_file = request.path.startswith("/relay/slots/")
        fault = self.fault if slot_file else ""
        if request.method == "GET" and fault in ("stall", "reset", "html", "not-a-slot-file"):
            self.faulted.append(f"GET {request.path}")
            return await self._bad_download(request, fault)
        if request.method == "PUT" and fault == "garbage-answer":
            self.faulted.append(f"PUT {request.path}")
            async with self._upstream(request) as up:
                await up.read()
            return web.Response(status=201, text="<html><body>Saved!</body></html>", content_type="text/html")
        async with self._upstream(request) as up:
            return await self._relay_answer(request, up)

    def _upstream(self, request: web.Request) -> Any:
        assert self._client is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        data = request.content.iter_chunked(_CHUNK) if request.body_exists else None
        timeout = aiohttp.ClientTimeout(total=300)
        url = self.relay_base + request.path_qs
        return self._client.request(request.method, url, headers=headers, data=data, timeout=timeout)

    async def _relay_answer(self, request: web.Request, up: aiohttp.ClientResponse) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=up.status, headers={k: v for k, v in up.headers.items() if k.lower() not in _HOP}
        )
        if up.content_length is not None:
            resp.content_length = up.content_length
        await resp.prepare(request)
        async for chunk in up.content.iter_chunked(_CHUNK):
            await resp.write(chunk)
        await resp.write_eof()
        return resp

    async def _bad_download(self, request: web.Request, fault: str) -> web.StreamResponse:
        if fault == "html":
            return web.Response(text="<html><body>Welcome to nginx!</body></html>", content_type="text/html")
        async with self._upstream(request) as up:
            if up.status != 200:
                return await self._relay_answer(request, up)
            real = await up.read()
        body = os.urandom(len(real)) if fault == "not-a-slot-file" else real
        headers = {"Content-Type": "application/octet-stream", SHA256_HEADER: hashlib.sha256(body).hexdigest()}
        resp = web.StreamResponse(headers=headers)
        resp.content_length = len(body)
        await resp.prepare(request)
        if fault == "not-a-slot-file":
            await resp.write(body)
            await resp.write_eof()
            return resp
        await resp.write(body[:_CHUNK])
        await asyncio.sleep(0.2)  # the part sent reaches the caller before the fault
        transport = request.transport
        if fault == "reset" and transport is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None:  # a close with SO_LINGER 0 sends RST, as a killed peer's kernel does
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
            return resp
        for _ in range(1200):  # stall: silence until the caller hangs up (2 minutes at the most)
            if transport is None or transport.is_closing():
                break
            await asyncio.sleep(0.1)
        return resp
