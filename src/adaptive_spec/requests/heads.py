"""The request path's calls into the head store (`kv/heads/`): before forwarding a session's first request, restore a
stored head into its slot when that pays (the route's reason and its new-token estimate say so), and likewise for a
session's first request after its server restarted; after serving a request, hand its timings back (an inert restore is
learned, a first turn saved as a head in the background, a later turn's state saved once its session is idle).

Servers that start or come back after a restart get their most recent heads back (`watch_servers`). Also `GET`/`DELETE
/adaptive/heads`. With `--project-key`, every head is kept, found, listed and deleted within the tenant scope of the key
the request was sent with (its path's project does not count: `kv/heads/plan.tenant_scope`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from aiohttp import web

from adaptive_spec.access.rules import key_accepted
from adaptive_spec.kv.heads.plan import BLOCK_CHARS, text_blocks
from adaptive_spec.kv.heads.store import HeadStore
from adaptive_spec.kv.heads.values import Restored
from adaptive_spec.kv.moves import SlotMove
from adaptive_spec.llama.launch import RESTART_ON_REQUEST
from adaptive_spec.llama.upstreams import Upstream
from adaptive_spec.policy.model import HeadsPolicy
from adaptive_spec.requests.app_keys import BUS, MEASURING, ROUTER, UPSTREAMS
from adaptive_spec.requests.gate import ACCESS, request_keys
from adaptive_spec.requests.lifecycle import ProxyRequest
from adaptive_spec.routing.contract import Route
from adaptive_spec.routing.decision import Decision, Moved
from adaptive_spec.routing.prompt.pieces import piece_texts
from adaptive_spec.routing.prompt.prefix import tokens_beyond
from adaptive_spec.telemetry.events import Event, ProfileDown, ProfileUp

HEADS = web.AppKey("heads", HeadStore)
log = logging.getLogger(__name__)


async def before_forward(request: web.Request, req: ProxyRequest, chosen: Upstream) -> None:
    """Never raises: a store that fails leaves the request to prefill as it would have."""
    app = request.app
    try:
        await _before_forward(app, req, chosen, _scope(request))
    except Exception:  # the store's own failures are caught inside it; this is the last guard of the request
        log.exception("heads: request %s goes on without a warm start", req.request_id)
    store = app.get(HEADS)
    if store is not None:
        store.forwarded(chosen, req.route.slot if req.route is not None else None, req.request_id)


def forwarded_again(request: web.Request, req: ProxyRequest, chosen: Upstream) -> None:
    """A request sent once more, to another server (a failover): counted by the store as any forward (no restore is
    tried for it: its route was made for the server that failed)."""
    store = request.app.get(HEADS)
    if store is not None:
        store.forwarded(chosen, req.route.slot if req.route is not None else None, None)


def moving_kv(app: web.Application, route: Route) -> contextlib.AbstractAsyncContextManager[None]:
    """A route's KV move (a handoff, a remote prefill's restore) inside the store's accounting: its lock held and the
    slot it fills counted as used (`HeadStore.moving`); nothing without a store or a move."""
    store, move = app.get(HEADS), route.move
    if store is None or move is None:
        return contextlib.nullcontext()
    at = move.target if isinstance(move, SlotMove) else move.at
    upstream = app[UPSTREAMS].get(at.profile, at.replica)
    if upstream is None:
        return contextlib.nullcontext()
    return store.moving(upstream, at.slot, locked=isinstance(move, SlotMove))


def served(request: web.Request, req: ProxyRequest, chosen: Upstream) -> None:
    try:
        _served(request.app, req, chosen, _scope(request))
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


async def _before_forward(app: web.Application, req: ProxyRequest, chosen: Upstream, scope: str) -> None:
    store, route = app.get(HEADS), req.route
    if store is None or route is None or req.assignment is None or route.decision.side or not route.pieces:
        return
    if not store.arriving(req.assignment.session_id, chosen, scope) or not heads_policy(req).enabled:
        return
    decision = route.decision
    slot_tokens = decision.context_tokens - decision.new_tokens if decision.new_tokens is not None else 0
    prefill = app[ROUTER].speeds.prefill_rate()
    pieces = [p.digest for p in route.pieces]
    blocks = _blocks(req)
    restored = await store.restore(chosen, route.slot, pieces, slot_tokens, prefill, scope, blocks)
    store.begin(req.request_id, restored)
    if restored is not None:
        req.route = replace(route, decision=_warm_decision(route, restored))


def _blocks(req: ProxyRequest) -> list[tuple[bytes, ...]]:
    """Each piece's `text_blocks` of the body the router read (a session's first request only: the texts are read
    and hashed again); [] when its texts do not line up with the route's pieces."""
    body = req.rewrite.body if req.rewrite is not None else req.parsed.body if req.parsed is not None else None
    texts = piece_texts(body) if body is not None else []
    if req.route is None or len(texts) != len(req.route.pieces):
        return []
    return [text_blocks(kind, text) for kind, text in texts]


def _warm_decision(route: Route, restored: Restored) -> Decision:
    """The route's reason says what was restored (and how much of it the prompt shares), and its new-token estimate
    counts only the pieces after the head, less the blocks of the piece the prompt parts from it in, at the rate the
    route's estimate took (the head's own tokens are llama-server's count, on another scale)."""
    decision = route.decision
    new_tokens = decision.new_tokens
    if new_tokens is not None:
        beyond = tokens_beyond(route.pieces, restored.pieces, route.chars_per_token)
        beyond = max(1, beyond - round(restored.blocks * BLOCK_CHARS / route.chars_per_token))
        shared = restored.pieces or restored.blocks
        new_tokens = min(new_tokens, beyond) if shared else max(1, new_tokens - restored.tokens)
    return decision.after(Moved(restored.reason(), new_tokens))


def _served(app: web.Application, req: ProxyRequest, chosen: Upstream, scope: str) -> None:
    store, route, timings = app.get(HEADS), req.route, req.meter.timings
    if store is None or route is None:
        return
    arriving, restored = store.end(req.request_id)
    mark = store.mark_of(req.request_id)
    if timings is None or req.outcome.status != 200 or req.assignment is None or not route.pieces:
        return
    policy = heads_policy(req)
    if not policy.enabled:
        return
    history = any(p.assistant for p in route.pieces)  # a reply in the prompt: a session's state, not a head
    first = arriving and not history
    store.served(
        chosen,
        route.slot,
        [p.digest for p in route.pieces],
        [p.chars for p in route.pieces],
        None if timings.from_usage else timings.cache_n,  # usage may leave cached tokens out: no judging on it
        (timings.prompt_n + timings.cache_n, timings.predicted_n),
        restored,
        (req.client, req.project, scope),
        policy.min_tokens,
        first=first,
        session=None if route.decision.side else req.assignment.session_id,
        idle_s=policy.session_idle_s,
        mark=mark,
        share_bytes=int(policy.share_gb * 1024**3),
        blocks=_blocks(req) if first and timings.prompt_n + timings.cache_n >= policy.min_tokens else (),
    )


def watch_servers(app: web.Application) -> None:
    """Warm starts when the proxy starts (every server it serves) and when a server comes back up (a restart)."""

    async def at_start(app: web.Application) -> AsyncIterator[None]:
        store = app.get(HEADS)
        if store is not None:
            measuring = app.get(MEASURING) or {}  # the speed measurements at start go first (measured_speeds.py)
            for upstream in _one_per_server(app):
                store.warm_start(upstream, "at start", after=measuring.get(upstream.base_url))
        yield

    emptied: set[tuple[str, int]] = set()  # restarts asked for to empty the server: no head goes back into it

    def on_event(event: Event) -> None:
        store = app.get(HEADS)
        if store is None or not isinstance(event, ProfileUp | ProfileDown):
            return
        upstream, which = app[UPSTREAMS].get(event.profile, event.replica), (event.profile, event.replica)
        if upstream is None:
            return
        if isinstance(event, ProfileDown):
            store.server_down(upstream)
            if event.reason == RESTART_ON_REQUEST:
                emptied.add(which)
        elif upstream in _one_per_server(app):

            def erased() -> None:  # a restarted server holds no session's KV: the router must not count on it
                app[ROUTER].slots_erased(*which)

            store.warm_start(upstream, "after a restart", erased, restore=which not in emptied)
            emptied.discard(which)

    app.cleanup_ctx.append(at_start)
    app[BUS].listen(on_event)


def displaced(app: web.Application) -> Callable[[Upstream], None]:
    """What the store is built with to tell the router when a slot action acted on a request's KV (llama-server
    deferred it behind that request): the router must not count on that server's slots."""

    def tell(upstream: Upstream) -> None:
        app[ROUTER].slots_erased(upstream.name, upstream.replica)

    return tell


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
