"""Driving the router in tests the way the proxy does: built with its KV effects, and through its two calls,
`route()` and `complete()`, with the KV move a route asks for carried out between them through a mover, as the request
path does."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp

from adaptive_spec.kv.effects import KvEffects
from adaptive_spec.kv.movers import SlotMover
from adaptive_spec.kv.moves import HandoffResult, PrefillAsk, RemotePrefillResult, SlotMove
from adaptive_spec.llama.upstreams import UpstreamTable
from adaptive_spec.requests.carry_out import Mover, carry_out
from adaptive_spec.routing.contract import Completion, FixedPolicy, PolicySource, Route, RouteRequest
from adaptive_spec.routing.router import Router
from adaptive_spec.telemetry.records import Timings


def _no_client() -> aiohttp.ClientSession:
    raise AssertionError("this test's router makes no HTTP calls")


def kv_effects(
    table: UpstreamTable,
    *,
    slot_dir: Path | None = None,
    mover: SlotMover | None = None,
    client: aiohttp.ClientSession | None = None,
) -> KvEffects:
    """The KV effects `build_app` makes: slot moves through `mover` (or the shared directory `slot_dir`). The same
    object is the router's `Effects` and the request path's `Mover`: pass it to both."""
    return KvEffects(table, (lambda: client) if client is not None else _no_client, slot_dir=slot_dir, mover=mover)


def make_router(
    table: UpstreamTable,
    slots: Mapping[str, int],
    kinds: Mapping[str, tuple[str, ...] | None],
    *,
    effects: KvEffects | None = None,
    servers: Mapping[tuple[str, int], str] | None = None,
    policies: PolicySource | None = None,
) -> Router:
    """A router with `effects` (none: its own, which move nothing), as `build_app` makes it."""
    return Router(table, policies or FixedPolicy(), slots, kinds, effects or kv_effects(table), servers=servers)


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


class _NoMover:
    """A test that routes without a mover asks for no move."""

    async def move_slot(self, move: SlotMove) -> HandoffResult:
        raise AssertionError(f"a move was asked for ({move}): pass the test's mover")

    async def prefill_elsewhere(self, ask: PrefillAsk) -> RemotePrefillResult | None:
        raise AssertionError(f"a remote prefill was asked for ({ask}): pass the test's mover")


NO_MOVER = _NoMover()


async def routed(router: Router, ask: RouteRequest, mover: Mover = NO_MOVER) -> Route:
    """Planned, then its KV move carried out through `mover`, as the request path does."""
    route = router.route(ask)
    assert isinstance(route, Route), route
    return await carry_out(router, mover, route)


def route(router: Router, ask: RouteRequest, mover: Mover = NO_MOVER) -> Route:
    """`route()` from a test without an event loop of its own."""
    return asyncio.run(routed(router, ask, mover))


async def serve(router: Router, ask: RouteRequest, timings: Timings, reply: str = "", mover: Mover = NO_MOVER) -> Route:
    """One request routed and completed in full."""
    done = await routed(router, ask, mover)
    router.complete(done, Completion(True, timings, reply))
    return done


def served(router: Router, ask: RouteRequest, timings: Timings, reply: str = "", mover: Mover = NO_MOVER) -> Route:
    """`serve()` from a test without an event loop of its own."""
    return asyncio.run(serve(router, ask, timings, reply, mover))
