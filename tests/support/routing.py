"""Driving the router in tests the way the proxy does: built with its KV effects, and through its two calls,
`route()` and `complete()`, with the KV move a route asks for carried out between them as the request path does."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp

from adaptive_spec.kv.effects import KvEffects
from adaptive_spec.kv.movers import SlotMover
from adaptive_spec.llama.upstreams import UpstreamTable
from adaptive_spec.requests.handler import carry_out
from adaptive_spec.routing.contract import Completion, FixedPolicy, PolicySource, Route, RouteRequest
from adaptive_spec.routing.router import Router
from adaptive_spec.telemetry.records import Timings


def _no_client() -> aiohttp.ClientSession:
    raise AssertionError("this test's router makes no HTTP calls")


def make_router(
    table: UpstreamTable,
    slots: Mapping[str, int],
    kinds: Mapping[str, tuple[str, ...] | None],
    *,
    slot_dir: Path | None = None,
    mover: SlotMover | None = None,
    servers: Mapping[tuple[str, int], str] | None = None,
    policies: PolicySource | None = None,
    client: aiohttp.ClientSession | None = None,
) -> Router:
    """A router whose KV moves go through `mover` (or the shared directory `slot_dir`), as `build_app` makes it."""
    effects = KvEffects(table, (lambda: client) if client is not None else _no_client, slot_dir=slot_dir, mover=mover)
    return Router(table, policies or FixedPolicy(), slots, kinds, effects, servers=servers)


def request(
    body: Mapping[str, Any],
    session: str | None,
    *,
    pinned: str | None = None,
    turns: int = 0,
    copy_share: float | None = None,
    takes_slot: bool = True,
    client_slot: int | None = None,
    body_bytes: int | None = None,
) -> RouteRequest:
    return RouteRequest(
        body=body,
        body_bytes=len(str(body)) if body_bytes is None else body_bytes,
        session_id=session,
        session_turns=turns,
        copy_share=copy_share,
        project="default",
        workspace=None,
        pinned=pinned,
        takes_slot=takes_slot,
        client_slot=client_slot,
    )


async def routed(router: Router, ask: RouteRequest) -> Route:
    """Planned, then its KV move carried out through the router's effects, as the request path does."""
    route = router.route(ask)
    assert isinstance(route, Route), route
    return await carry_out(router, route)


def route(router: Router, ask: RouteRequest) -> Route:
    """`route()` from a test without an event loop of its own."""
    return asyncio.run(routed(router, ask))


async def serve(router: Router, ask: RouteRequest, timings: Timings, reply: str = "") -> Route:
    """One request routed and completed in full."""
    done = await routed(router, ask)
    router.complete(done, Completion(True, timings, reply))
    return done


def served(router: Router, ask: RouteRequest, timings: Timings, reply: str = "") -> Route:
    """`serve()` from a test without an event loop of its own."""
    return asyncio.run(serve(router, ask, timings, reply))
