"""The request path's calls into the head store (`kv/heads/`): before routing a request, what the store shows of the
heads it may get restored on each server (a session's first request there, or its first after its server restarted):
the router decides the restore with the route (`RouteRequest.heads`), and the store carries it out for the request path
(`restorer`); after serving a request, what the store's tables show of it (`HeadStore.ended`): the router decides its
save on that (`routing/move_planner.plan_save`: a first turn saved as a head in the background, a later turn's state
once its session is idle, an inert restore judged), and the store carries it out (`HeadStore.after_turn`).

Servers that start or come back after a restart get their most recent heads back (`watch_servers`); without a head
store, one that comes back fresh is still known to hold no session's KV. Also `GET`/`DELETE
/adaptive/heads`. With `--project-key`, every head is kept, found, listed and deleted within the tenant scope of the key
the request was sent with (its path's project does not count: `kv/heads/matching.tenant_scope`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import replace
from typing import Any

import aiohttp
from aiohttp import web

from adaptive_spec.access.rules import key_accepted
from adaptive_spec.kv.heads.matching import text_blocks
from adaptive_spec.kv.heads.server import fresh
from adaptive_spec.kv.heads.store import HeadStore
from adaptive_spec.kv.heads.values import HeadsView, Restored
from adaptive_spec.kv.moves import HeadRestore, SlotMove
from adaptive_spec.llama.launch import RESTART_ON_REQUEST
from adaptive_spec.llama.upstreams import Upstream
from adaptive_spec.policy.model import HeadsPolicy
from adaptive_spec.requests.app_keys import BUS, CLIENT, MEASURING, ROUTER, SHARED, UPSTREAMS
from adaptive_spec.requests.carry_out import HeadRestorer
from adaptive_spec.requests.forwarding.outcome import Outcome
from adaptive_spec.requests.gate import ACCESS, request_keys
from adaptive_spec.requests.lifecycle import ProxyRequest
from adaptive_spec.routing.contract import Route, TurnEnd
from adaptive_spec.routing.move_planner import plan_save
from adaptive_spec.routing.prompt.pieces import piece_texts
from adaptive_spec.telemetry.events import Event, ProfileDown, ProfileUp

HEADS = web.AppKey("heads", HeadStore)
log = logging.getLogger(__name__)
Views = tuple[Mapping[tuple[str, int], HeadsView], tuple[tuple[bytes, ...], ...]]


async def views(request: web.Request, req: ProxyRequest, body: Mapping[str, Any]) -> Views:
    """Before routing: what the store shows of each server where this request may get a head restored (a session's
    first request there, its project's heads policy on), and its pieces' `text_blocks` when it shows any. Never raises:
    a store that fails leaves the request to prefill as it would have."""
    store = request.app.get(HEADS)
    if store is None or req.assignment is None or not heads_policy(req).enabled:
        return {}, ()
    try:
        scope, session = _scope(request), req.assignment.session_id
        shown: dict[tuple[str, int], HeadsView] = {}
        for upstream in request.app[UPSTREAMS].all():
            view = await store.view(upstream, session, scope)
            if view is not None:
                shown[(upstream.name, upstream.replica)] = view
        return shown, _blocks(body) if shown else ()
    except Exception:  # the store's own failures are caught inside it; this is the last guard of the request
        log.exception("heads: request %s goes on without a warm start", req.request_id)
        return {}, ()


def arrived(request: web.Request, req: ProxyRequest, route: Route) -> bool:
    """The route came back: whether its request is its session's first the store sees on that server (counted from now
    on; a side request or one without pieces is not), with its heads policy on. Only then is a head restored for it."""
    store = request.app.get(HEADS)
    if store is None or req.assignment is None or route.decision.side or not route.pieces:
        return False
    chosen = request.app[UPSTREAMS].get(route.profile, route.replica)
    if chosen is None or not store.arriving(req.assignment.session_id, chosen, _scope(request)):
        return False
    return heads_policy(req).enabled


def began(request: web.Request, req: ProxyRequest, restored: Restored | None) -> None:
    """A session's first request, its move carried out: the store learns from it once it is served (`served`)."""
    store = request.app.get(HEADS)
    if store is not None:
        store.begin(req.request_id, restored)


def before_forward(request: web.Request, req: ProxyRequest, chosen: Upstream) -> None:
    """Every request forwarded, counted by the store (a save waiting on its slot is dropped)."""
    store = request.app.get(HEADS)
    if store is not None:
        store.forwarded(chosen, req.route.slot if req.route is not None else None, req.request_id)


def restorer(app: web.Application) -> HeadRestorer:
    """What carries out the head restores routes ask for (`carry_out`): the head store."""
    return _StoreRestorer(app)


class _StoreRestorer:
    def __init__(self, app: web.Application) -> None:
        self._app = app

    async def restore_head(self, move: HeadRestore) -> Restored | None:
        store, at = self._app.get(HEADS), move.at
        upstream = self._app[UPSTREAMS].get(at.profile, at.replica)
        if store is None or upstream is None or upstream.base_url != move.server:
            return None
        try:
            return await store.restore(upstream, move)
        except Exception:  # as in `views`: the last guard of the request
            log.exception("heads: a restore on %s failed: its request prefills", upstream.label)
            return None


def forwarded_again(request: web.Request, req: ProxyRequest, chosen: Upstream) -> None:
    """A request sent once more, to another server (a failover): counted by the store as any forward (no restore is
    tried for it: its route was made for the server that failed)."""
    store = request.app.get(HEADS)
    if store is not None:
        store.forwarded(chosen, req.route.slot if req.route is not None else None, None)


def moving_kv(app: web.Application, route: Route) -> contextlib.AbstractAsyncContextManager[None]:
    """A route's KV move (a handoff, a remote prefill's restore) inside the store's accounting: its lock held and the
    slot it fills counted as used (`HeadStore.moving`); nothing without a store or a move, nor for a head restore
    (the store's own, under its lock)."""
    store, move = app.get(HEADS), route.move
    if store is None or move is None or isinstance(move, HeadRestore):
        return contextlib.nullcontext()
    at = move.target if isinstance(move, SlotMove) else move.at
    upstream = app[UPSTREAMS].get(at.profile, at.replica)
    if upstream is None:
        return contextlib.nullcontext()
    return store.moving(upstream, at.slot, locked=isinstance(move, SlotMove))


def served(request: web.Request, req: ProxyRequest, chosen: Upstream, outcome: Outcome) -> None:
    try:
        _served(request.app, req, chosen, outcome.status, _scope(request))
    except Exception:  # as above: the request was served; only the head is lost
        log.exception("heads: request %s: its head is not kept", req.request_id)


def _scope(request: web.Request) -> str:
    """The tenant scope of the key the request was sent with ("": no project keys, heads are shared)."""
    store = request.app.get(HEADS)
    if store is None:
        return ""
    return store.scope_of(request_keys(request))


def heads_policy(req: ProxyRequest) -> HeadsPolicy:
    """The project's heads policy, as resolved once before routing (`Prepared.policy`); a request that was not
    prepared (none reaches the store) keeps and gets no head."""
    return req.prepared.policy.heads if req.prepared is not None else HeadsPolicy(enabled=False)


def _blocks(body: Mapping[str, Any]) -> tuple[tuple[bytes, ...], ...]:
    """Each piece's `text_blocks` of the body the router reads (a session's first request only: the texts are read
    and hashed again)."""
    return tuple(text_blocks(kind, text) for kind, text in piece_texts(body))


def _route_blocks(req: ProxyRequest) -> tuple[tuple[bytes, ...], ...]:
    """`_blocks` of the body the router read; () when its texts do not line up with the route's pieces."""
    body = req.rewrite.body if req.rewrite is not None else req.parsed.body if req.parsed is not None else None
    blocks = _blocks(body) if body is not None else ()
    return blocks if req.route is not None and len(blocks) == len(req.route.pieces) else ()


def _served(app: web.Application, req: ProxyRequest, chosen: Upstream, status: int, scope: str) -> None:
    """The completion step for the store: what its tables show of the request (`ended`), the save the router decides on
    it (`plan_save`, pure), carried out by the store (`after_turn`)."""
    store, route = app.get(HEADS), req.route
    if store is None or route is None:
        return
    end = TurnEnd(
        status,
        req.meter.timings,
        heads_policy(req),
        store.ended(req.request_id),
        chosen.base_url,
        preset=chosen.upstream_model is not None,
        owner=(req.client, req.project, scope),
        blocks=lambda: _route_blocks(req),
    )
    after = plan_save(route, end)
    if after is not None:
        store.after_turn(chosen, after)


def watch_servers(app: web.Application) -> None:
    """Warm starts when the proxy starts (every server it serves) and when a server comes back up (a restart); without
    a head store, a server that comes back fresh is still found emptied (`_found_fresh`)."""
    checks: set[asyncio.Task[None]] = set()

    async def at_start(app: web.Application) -> AsyncIterator[None]:
        store = app.get(HEADS)
        if store is not None:
            measuring = app.get(MEASURING) or {}  # the speed measurements at start go first (measured_speeds.py)
            for upstream in _one_per_server(app):
                store.warm_start(upstream, "at start", after=measuring.get(upstream.base_url))
        yield
        for task in list(checks):
            task.cancel()
        await asyncio.gather(*checks, return_exceptions=True)

    emptied: set[tuple[str, int]] = set()  # restarts asked for to empty the server: no head goes back into it

    def on_event(event: Event) -> None:
        if not isinstance(event, ProfileUp | ProfileDown):
            return
        store = app.get(HEADS)
        upstream, which = app[UPSTREAMS].get(event.profile, event.replica), (event.profile, event.replica)
        if upstream is None:
            return
        if store is None:
            if isinstance(event, ProfileUp) and upstream in _one_per_server(app):
                task = asyncio.get_running_loop().create_task(_found_fresh(app, upstream))
                checks.add(task)
                task.add_done_callback(checks.discard)
            return
        if isinstance(event, ProfileDown):
            store.server_down(upstream)
            if event.reason == RESTART_ON_REQUEST:
                emptied.add(which)
        elif upstream in _one_per_server(app):

            def erased() -> None:  # a restarted server holds no session's KV: the router must not count on it
                app[ROUTER].slots_erased(*which)
                # Nor the other proxies' (told once it is known fresh: a server only slow to answer keeps its KV).
                tell_emptied(app, upstream, restarted=True)

            store.warm_start(upstream, "after a restart", erased, restore=which not in emptied)
            emptied.discard(which)

    app.cleanup_ctx.append(at_start)
    app[BUS].listen(on_event)


async def _found_fresh(app: web.Application, upstream: Upstream) -> None:
    """A server back up, with no head store to find it fresh: when it has prefilled nothing (its /metrics), it
    restarted and holds no session's KV: the router, and the other proxies, must not count on it."""
    client = app.get(CLIENT)
    try:
        if client is None or not await fresh(client, upstream):
            return
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.info("%s back up: not known fresh (%s); its sessions' KV is still counted on", upstream.label, exc)
        return
    app[ROUTER].slots_erased(upstream.name, upstream.replica)
    tell_emptied(app, upstream, restarted=True)


def displaced(app: web.Application) -> Callable[[Upstream], None]:
    """What the store is built with to tell the router when a slot action acted on a request's KV (llama-server
    deferred it behind that request): the router must not count on that server's slots."""

    def tell(upstream: Upstream) -> None:
        app[ROUTER].slots_erased(upstream.name, upstream.replica)
        tell_emptied(app, upstream, restarted=False)

    return tell


def tell_emptied(app: web.Application, upstream: Upstream, restarted: bool) -> None:
    """This proxy saw the server's slots emptied: the other proxies are told (where the state is shared), so their
    routers do not count on the KV they placed there."""
    shared = app.get(SHARED)
    if shared is not None:
        shared.erased(upstream.base_url, restarted)


def _one_per_server(app: web.Application) -> list[Upstream]:
    """One upstream for each llama-server (profiles that are settings of one server share its slots)."""
    seen: dict[str, Upstream] = {}
    for upstream in app[UPSTREAMS].all():
        seen.setdefault(upstream.base_url, upstream)
    return list(seen.values())


def _view_scope(request: web.Request, store: HeadStore) -> str | None:
    """The heads a caller sees and deletes: with project keys, its own scope's only, but for a caller with the main
    key (a key that is no project's), who sees them all; without project keys, all of them."""
    project_keys = store.config.project_keys
    if not project_keys:
        return None
    access = request.app[ACCESS]
    main = tuple(key for key in access.api_keys if key not in project_keys)
    return None if main and key_accepted(replace(access, api_keys=main), request_keys(request)) else _scope(request)


async def _heads_view(request: web.Request) -> web.Response:
    store = request.app.get(HEADS)
    if store is None:
        return web.json_response({"enabled": False, "heads": []})
    return web.json_response({"enabled": True, **store.describe(_view_scope(request, store))})


async def _delete_view(request: web.Request) -> web.Response:
    store = request.app.get(HEADS)
    head = request.match_info.get("head_id")
    removed = await store.delete(head, _view_scope(request, store)) if store is not None else 0
    if head is not None and removed == 0:
        return web.json_response(
            {"error": {"message": f"no head {head!r}", "type": "not_found", "code": "no_head"}}, status=404
        )
    return web.json_response({"removed": removed})


def add_heads_views(app: web.Application) -> None:
    app.router.add_get("/adaptive/heads", _heads_view)
    app.router.add_delete("/adaptive/heads", _delete_view)
    app.router.add_delete("/adaptive/heads/{head_id}", _delete_view)
