"""The proxy's aiohttp app stopped after its requests ended: what `AppRunner.cleanup()` does, in its order, but each
step bounded on its own.

Under one bound for all, connections aiohttp was slow to close cut off the app's cleanup part-way: the trace file, the
statistics worker and the head store were left as they were."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from aiohttp import web

CONNECTIONS_STOP_S = 1.5  # aiohttp's wait per connection (0.5 s in `serve`) is spent twice at most
APP_STEP_STOP_S = 1.0  # the app's on_shutdown, then its cleanup contexts: ms each, the bound is for a hung one


async def stop_app(
    runner: web.AppRunner,
    per_connection_s: float,
    connections_s: float = CONNECTIONS_STOP_S,
    app_step_s: float = APP_STEP_STOP_S,
) -> list[str]:
    """The listening sites, the app's on_shutdown, aiohttp's connections (`per_connection_s` each, then cancelled)
    and the app's cleanup contexts, stopped in turn; returns the steps cut off at their bound, for the log."""
    cut: list[str] = []
    server = runner.server
    for site in list(runner.sites):  # stopped already after a signal; closing a listener does not wait
        await site.stop()
    if server is not None:
        server.pre_shutdown()  # idle connections closed at once
        await _within(runner.app.shutdown(), app_step_s, "the app's shutdown", cut)
        await _within(server.shutdown(per_connection_s), connections_s, "aiohttp's connections", cut)
    await _within(runner.app.cleanup(), app_step_s, "the app's cleanup contexts", cut)
    return cut


async def _within(work: Awaitable[None], limit_s: float, what: str, cut: list[str]) -> None:
    try:
        async with asyncio.timeout(limit_s):
            await work
    except TimeoutError:
        cut.append(f"{what} cut off at {limit_s:g} s")
