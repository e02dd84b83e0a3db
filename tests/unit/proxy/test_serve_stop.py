"""`serve`'s stop of its own app (proxy/run.py, proxy/app_stop.py): a connection aiohttp does not close within its
bound costs neither the app's cleanup contexts (the trace file, the statistics worker, the head store) nor the close
of the proxy's client session."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from aiohttp import web

from adaptive_spec.proxy import run
from adaptive_spec.proxy.app import ProxySettings
from adaptive_spec.proxy.app_stop import CONNECTIONS_STOP_S
from adaptive_spec.proxy.run import base_url, listen
from adaptive_spec.proxy.settings import ServeSettings

pytestmark = pytest.mark.asyncio(loop_scope="function")
PER_CONNECTION_S = 30.0  # aiohttp's own wait for a handler, long (its default is 60 s): only the bound ends it


def _context(name: str, done: list[str]) -> Callable[[web.Application], AsyncIterator[None]]:
    async def context(_: web.Application) -> AsyncIterator[None]:
        yield
        done.append(name)

    return context


async def test_connections_cut_off_at_their_bound_leave_the_cleanup_and_the_client_session_to_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(run, "_AIOHTTP_SHUTDOWN_S", PER_CONNECTION_S)
    handling, released = asyncio.Event(), asyncio.Event()
    done: list[str] = []

    async def busy(_: web.Request) -> web.Response:  # a request still being handled when the app stops
        handling.set()
        await released.wait()
        return web.Response(text="late")

    async def on_shutdown(_: web.Application) -> None:
        done.append("on_shutdown")

    app = web.Application()
    app.router.add_get("/", busy)
    app.on_shutdown.append(on_shutdown)
    app.cleanup_ctx.append(_context("trace file", done))  # first in, last out
    app.cleanup_ctx.append(_context("statistics worker", done))
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=PER_CONNECTION_S)
    await runner.setup()
    sockets = listen("127.0.0.1", 0)
    await web.SockSite(runner, sockets[0]).start()
    client = aiohttp.ClientSession()
    stopping = run._Run(ServeSettings("127.0.0.1", 0, ProxySettings(), None), sockets, client, runner=runner)
    async with aiohttp.ClientSession() as caller:
        request = asyncio.create_task(caller.get(base_url("127.0.0.1", sockets[0])))
        await asyncio.wait_for(handling.wait(), 10)
        await asyncio.wait_for(stopping.close(), PER_CONNECTION_S / 2)  # not aiohttp's own wait
        released.set()
        with contextlib.suppress(aiohttp.ClientError):
            (await request).close()
    assert done == ["on_shutdown", "statistics worker", "trace file"]
    assert client.closed
    [phase] = stopping.phases
    assert phase.startswith("proxy tasks") and phase.endswith(
        f"(aiohttp's connections cut off at {CONNECTIONS_STOP_S:g} s)"
    )
