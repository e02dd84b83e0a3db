"""The request path's two calls into the head store (`kv/heads/`): before forwarding a session's first request,
restore a stored head into its slot when that pays (the route's reason says so); after serving it, hand its timings
back (an inert restore is learned, a new head saved in the background). Also `GET`/`DELETE /adaptive/heads`."""

from __future__ import annotations

import logging
from dataclasses import replace

from aiohttp import web

from adaptive_spec.kv.heads.store import HeadStore
from adaptive_spec.requests.app_keys import ROUTER
from adaptive_spec.requests.lifecycle import ProxyRequest
from adaptive_spec.servers.upstreams import Upstream

HEADS = web.AppKey("heads", HeadStore)
log = logging.getLogger(__name__)


async def before_forward(app: web.Application, req: ProxyRequest, chosen: Upstream) -> None:
    """Never raises: a store that fails leaves the request to prefill as it would have."""
    try:
        await _before_forward(app, req, chosen)
    except Exception:  # the store's own failures are caught inside it; this is the last guard of the request
        log.exception("heads: request %s goes on without a warm start", req.request_id)


def served(app: web.Application, req: ProxyRequest, chosen: Upstream) -> None:
    try:
        _served(app, req, chosen)
    except Exception:  # as above: the request was served; only the head is lost
        log.exception("heads: request %s: its head is not kept", req.request_id)


async def _before_forward(app: web.Application, req: ProxyRequest, chosen: Upstream) -> None:
    store, route = app.get(HEADS), req.route
    if store is None or route is None or req.assignment is None or route.decision.side or not route.pieces:
        return
    if not store.first_request(req.assignment.session_id):
        return
    decision = route.decision
    slot_tokens = decision.context_tokens - decision.new_tokens if decision.new_tokens is not None else 0
    prefill_s_per_token = app[ROUTER].speeds.prefill_s(decision.profile, 1.0)
    pieces = [p.digest for p in route.pieces]
    restored = await store.restore(chosen, route.slot, pieces, slot_tokens, prefill_s_per_token)
    store.begin(req.request_id, restored)
    if restored is not None:
        req.route = replace(route, decision=replace(decision, reason=f"{decision.reason}; {restored.reason()}"))


def _served(app: web.Application, req: ProxyRequest, chosen: Upstream) -> None:
    store, route, timings = app.get(HEADS), req.route, req.meter.timings
    if store is None or route is None:
        return
    first, restored = store.end(req.request_id)
    if not first or timings is None or req.outcome.status != 200 or timings.from_usage:
        return
    store.served(
        chosen,
        route.slot,
        [p.digest for p in route.pieces],
        [p.chars for p in route.pieces],
        timings.cache_n,
        timings.prompt_n + timings.cache_n,
        restored,
        req.client,
        req.project,
    )


async def _heads_view(request: web.Request) -> web.Response:
    store = request.app.get(HEADS)
    if store is None:
        return web.json_response({"enabled": False, "heads": []})
    return web.json_response({"enabled": True, **store.describe()})


async def _delete_view(request: web.Request) -> web.Response:
    store = request.app.get(HEADS)
    head = request.match_info.get("head_id")
    removed = store.delete(head) if store is not None else 0
    if head is not None and removed == 0:
        return web.json_response(
            {"error": {"message": f"no head {head!r}", "type": "not_found", "code": "no_head"}}, status=404
        )
    return web.json_response({"removed": removed})


def add_heads_views(app: web.Application) -> None:
    app.router.add_get("/adaptive/heads", _heads_view)
    app.router.add_delete("/adaptive/heads", _delete_view)
    app.router.add_delete("/adaptive/heads/{head_id}", _delete_view)
