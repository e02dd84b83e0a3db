"""What several proxies tell each other through the shared state, wired into this one: its head store's saves,
removals and inert restores told and the others' taken (`shared_state/heads.py`), and servers whose slots one proxy
saw emptied (erased, restarted) forgotten by every proxy's router and head store; the servers it launched recorded,
so that it alone warm-starts them."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence

from aiohttp import web

from adaptive_spec.kv.heads.values import HeadsConfig
from adaptive_spec.requests.app_keys import ROUTER, SHARED, UPSTREAMS
from adaptive_spec.requests.heads import HEADS
from adaptive_spec.shared_state.heads import SharedHeads
from adaptive_spec.shared_state.news import News

log = logging.getLogger(__name__)
SHARED_HEADS = web.AppKey("shared_heads", SharedHeads)


def shared_heads(app: web.Application, config: HeadsConfig) -> SharedHeads | None:
    """The head store's `told`, where the state is shared (its store is set once made: `share`)."""
    shared = app.get(SHARED)
    if shared is None:
        return None
    app[SHARED_HEADS] = heads = SharedHeads(shared, config.project_keys)
    return heads


def launching(app: web.Application, servers: Sequence[str]) -> None:
    """The servers this proxy launched: recorded in the shared state where its head store warm-starts them, so that
    it alone warms them after each restart (the other proxies on them leave it to it)."""
    shared, store = app.get(SHARED), app.get(HEADS)
    if shared is not None and store is not None and store.config.warm_start and not store.config.project_keys:
        shared.launching(servers)


def share(app: web.Application) -> None:
    """Hear the other proxies for the proxy's life: their heads, and the servers whose slots they saw emptied."""
    shared = app.get(SHARED)
    if shared is None:
        return
    if (heads := app.get(SHARED_HEADS)) is not None:
        heads.store = app.get(HEADS)

    def on_erased(server: str, restarted: bool) -> None:
        store = app.get(HEADS)
        for upstream in app[UPSTREAMS].all():
            if upstream.base_url == server:
                app[ROUTER].slots_erased(upstream.name, upstream.replica)
                if store is not None:
                    (store.server_down if restarted else store.emptied)(upstream)
        log.info("shared state: another proxy saw %s's slots %s", server, "restart" if restarted else "erased")

    shared.on_erased = on_erased

    async def heard(news: News) -> None:
        if heads is not None:
            await heads.heard(news)

    async def listening(_: web.Application) -> AsyncIterator[None]:
        task = asyncio.get_running_loop().create_task(shared.listening(heard))
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.cleanup_ctx.append(listening)
