"""The request handler: read and check the body, find the session, route it (and hand its KV over when it moves),
forward it upstream; the request's lifecycle (`requests/lifecycle.py`) records how it ended."""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import replace
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson
from aiohttp import web

from adaptive_spec.access.rules import with_model
from adaptive_spec.common.headers import PROFILE_HEADER, REPLICA_HEADER, REQUEST_ID_HEADER, ROUTE_HEADER
from adaptive_spec.kv.moves import SlotMove
from adaptive_spec.llama.speculation import merge_fields
from adaptive_spec.llama.upstreams import Upstream, UpstreamTable
from adaptive_spec.requests.apis import traits
from adaptive_spec.requests.app_keys import CLIENT, FRESH_CLIENT, LIFECYCLE, ROUTER, SESSIONS, SETTINGS, UPSTREAMS
from adaptive_spec.requests.body.compat import repaired
from adaptive_spec.requests.body.parse import ParsedRequest, parse_body, with_fields
from adaptive_spec.requests.body.repeats import guard, trailing_repeat
from adaptive_spec.requests.body.shapes import RequestProblem
from adaptive_spec.requests.body.token_rate import first_turn_rate
from adaptive_spec.requests.error_responses import answer
from adaptive_spec.requests.forward import forward
from adaptive_spec.requests.gate import routed_path
from adaptive_spec.requests.heads import before_forward, served
from adaptive_spec.requests.keepalive import PrefillKeepAlive
from adaptive_spec.requests.lifecycle import Prepared, ProxyRequest, Rewrite
from adaptive_spec.requests.outcome import CLIENT_GONE, SERVED, SHUTDOWN, Outcome
from adaptive_spec.requests.stranded import STRANDED
from adaptive_spec.routing.contract import Completion, Refusal, Route, RouteRequest
from adaptive_spec.routing.router import Router
from adaptive_spec.sessions.clients import client_name
from adaptive_spec.sessions.project import workspace_path_from_request
from adaptive_spec.sessions.tokenizers import CachingTokenizer
from adaptive_spec.streams.meter import ResponseMeter
from adaptive_spec.streams.output import LiveText

log = logging.getLogger(__name__)
# A body from this size on (a ~40k-token history) is parsed, grouped and routed in turns with the other streams' chunks.
_LARGE_BODY = 128 * 1024


class BodyTooLarge(Exception):
    pass


async def read_body(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge
    parts: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        parts.append(chunk)
    return b"".join(parts)


def choose_upstream(
    request: web.Request, table: UpstreamTable, name: str | None = None, replica: int | None = None
) -> Upstream | Outcome:
    """The upstream of profile `name` (default: the one the header pins, else the default), or the refusal.
    `replica`: which server of its pool (None: the first one up)."""
    name = name or request.headers.get(PROFILE_HEADER) or table.default
    if replica is None:
        up = [u for u in table.replicas(name) if table.replica_down_reason(name, u.replica) is None]
        replica = up[0].replica if up else 0
    upstream = table.get(name, replica)
    if upstream is None:
        known = ", ".join(table.names())
        message = f"unknown profile {name!r} in {PROFILE_HEADER}; known profiles: {known}"
        return Outcome(400, message, "unknown_profile", PROFILE_HEADER)
    reason = table.replica_down_reason(name, replica)
    if reason is not None:
        return Outcome(503, f"profile {name!r} at {upstream.base_url} is down: {reason}", "profile_unavailable")
    return upstream


def _upstream_query(request: web.Request, upstream: Upstream, api: str) -> str:
    """Router-mode servers take the preset as `?model=` on GET endpoints such as /props and /slots: always the
    profile's own (a client's `model` would make the router load another model)."""
    qs = request.rel_url.raw_query_string  # as sent: decoding it could turn an encoded '&' into a separator
    preset = upstream.upstream_model
    if preset is not None:
        kept = [p for p in qs.split("&") if p and p.split("=", 1)[0] != "model"]
        add = ["model=" + quote(preset, safe="")] if request.method == "GET" and api == "other" else []
        qs = "&".join(kept + add)
    return f"?{qs}" if qs else ""


def upstream_body(req: ProxyRequest, upstream: Upstream, watched: bool) -> tuple[bytes, bool]:
    """The bytes to send: the client's, unless a router preset must be named or per-token timings are wanted (for
    the live draft progress, only while a live view is `watched`: otherwise the answer's bytes pass on untouched).

    Returns (body, strip): strip says the client did not ask for per-token timings, so they are removed again.
    """
    parsed = req.parsed
    if parsed is None:
        preset = upstream.upstream_model
        return (with_model(req.body, preset) if preset is not None and req.body else req.body), False
    body, raw = (req.rewrite.body, req.rewrite.raw) if req.rewrite is not None else (parsed.body, req.body)
    added: dict[str, Any] = {}
    if traits(req.routed.api).speculation:
        settings = upstream.speculation
        cap = req.decision.n_max if req.decision is not None else None
        if cap is not None:  # the router's draft length for this session (routing/draft_length.py)
            settings = replace(settings, n_max=cap)
        added, req.speculation = merge_fields(body, settings, by="router" if cap is not None else "profile")
    strip = watched and parsed.stream and traits(req.routed.api).progress and "timings_per_token" not in body
    if strip:
        added["timings_per_token"] = True
    if req.slot is not None and "id_slot" not in body:
        added["id_slot"] = req.slot
    if upstream.upstream_model is not None and parsed.model != upstream.upstream_model:
        return orjson.dumps({**body, **added, "model": upstream.upstream_model}), strip
    return (with_fields(raw, added) if added else raw), strip


def _extra_headers(req: ProxyRequest, chosen: Upstream) -> dict[str, str]:
    """Sent upstream and back to the client: which request this is, the profile that served it, and why."""
    headers = {REQUEST_ID_HEADER: req.request_id, PROFILE_HEADER: chosen.name}
    if req.decision is not None:
        headers[ROUTE_HEADER] = req.decision.kind
    if req.pool_size > 1:
        headers[REPLICA_HEADER] = str(chosen.replica)
    return headers


async def _prepare(request: web.Request, req: ProxyRequest) -> Upstream | Outcome:
    """Read and check the body, find the session, choose the profile: an upstream, or the refusal to answer."""
    settings = request.app[SETTINGS]
    try:
        req.body = await read_body(request, settings.max_body_bytes)
    except BodyTooLarge:
        message = f"request body is larger than the limit of {settings.max_body_bytes} bytes"
        return Outcome(413, message, "request_too_large")
    if request.method == "POST" and traits(req.routed.api).generates:
        result = parse_body(req.routed.api, req.body)
        if isinstance(result, RequestProblem):
            return Outcome(400, result.message, result.code, result.param)
        large = len(req.body) >= _LARGE_BODY
        if large:  # a long history's parse took a millisecond: other streams' chunks go out before it is grouped
            await asyncio.sleep(0)
        req.prepared = prepared = _grouped(request, req, result)
        policies = request.app[ROUTER].policies
        if not policies.known(prepared.project, prepared.workspace):  # its files are read once, off the event loop
            await asyncio.to_thread(policies.load, prepared.project, prepared.workspace)
        if large:  # ... and before it is routed
            await asyncio.sleep(0)
        pinned = choose_upstream(request, request.app[UPSTREAMS]) if request.headers.get(PROFILE_HEADER) else None
        if isinstance(pinned, Outcome):
            return pinned
        req.rewrite = _rewrite(request, req, prepared)  # before routing: the server sees what is estimated
        return await _route(request, req)
    chosen = choose_upstream(request, request.app[UPSTREAMS])
    if isinstance(chosen, Upstream):
        req.replica, req.pool_size = chosen.replica, len(request.app[UPSTREAMS].replicas(chosen.name))
    return chosen


def _grouped(request: web.Request, req: ProxyRequest, parsed: ParsedRequest) -> Prepared:
    """The parsed request with the workspace its agent reveals (scanned once: for the project and the policy), its
    session and its project."""
    service = request.app[SESSIONS]
    headers = {k.lower(): v for k, v in request.headers.items()}
    workspace = workspace_path_from_request(headers, parsed.body)
    if service is None:
        return Prepared(parsed, workspace, None, req.project)
    assignment, project = service.assign(headers, parsed.body, req.routed.project, workspace)
    return Prepared(parsed, workspace, assignment, project)


def _rewrite(request: web.Request, req: ProxyRequest, prepared: Prepared) -> Rewrite | None:
    """The body to send upstream when it is not the client's: a shape llama-server refuses rewritten, an agent's
    loop on one tool call broken. The router estimates and places that body (it is what the server's cache will
    hold); the client's body still goes to the session statistics."""
    api, body = req.routed.api, prepared.parsed.body
    fixed = repaired(api, body)
    if fixed is not None:
        body = fixed.body
        log.info("request %s: %s", req.request_id, fixed.note)
    repeat = trailing_repeat(api, body)
    guarded = None
    if repeat is not None:
        agents = request.app[ROUTER].policies.policy_for(prepared.project, prepared.workspace).agents
        guarded = guard(api, body, repeat, agents.repeat_note_after, agents.repeat_text_after)
        if guarded is not None:
            body = guarded.body
            log.info("request %s: %s", req.request_id, guarded.describe())
    if fixed is None and guarded is None:
        return None
    return Rewrite(body, orjson.dumps(body), fixed.note if fixed is not None else None, guarded)


async def _failover(request: web.Request, req: ProxyRequest, failed: Upstream, outcome: Outcome) -> Upstream | None:
    """`failed` refused the connection, or stopped answering and the request was ended (nothing came back): mark it
    down (the health watch brings it back) and, in a pool, route the request again among the replicas still up. A
    session whose KV lived there is re-placed and re-prefills. None: no other replica is up, the refusal stands (this
    request's 503; the replica is marked down all the same, so the next request gets a 503 at once instead of trying
    it again)."""
    table = request.app[UPSTREAMS]
    if table.replica_down_reason(failed.name, failed.replica) is None:  # the health poll may have said so first
        why = "refused connections" if outcome.code == "upstream_unreachable" else "stopped answering"
        table.mark_down(failed.name, why, failed.replica, watch=True)
    if req.pool_size <= 1:
        return None
    if not any(table.replica_down_reason(failed.name, u.replica) is None for u in table.replicas(failed.name)):
        return None
    log.warning("request %s: nothing came back from %s; trying another replica", req.request_id, failed.label)
    req.meter = ResponseMeter()
    if req.route is None:
        chosen = choose_upstream(request, table, failed.name)
        return chosen if isinstance(chosen, Upstream) else None
    # Its load comes off the refused replica; nothing was served, nothing is learned.
    request.app[ROUTER].complete(req.route, Completion(ok=False))
    req.route = None
    routed = await _route(request, req)
    return routed if isinstance(routed, Upstream) else None


async def _route(request: web.Request, req: ProxyRequest) -> Upstream | Outcome:
    """A generating request: the router decides its profile, replica and slot, and moves the session's KV for it."""
    app, parsed = request.app, req.parsed
    assert parsed is not None
    service, assignment = app[SESSIONS], req.assignment
    session_id = assignment.session_id if assignment is not None else None
    turns, copy_share = 0, None
    if service is not None and session_id is not None:
        # The statistics folded so far, never waited for: a turn sent while its previous turn's update still runs
        # (a whole history to index: 100 ms and more) is routed on the turns before it.
        turns, copy_share = service.copy_state(session_id)
    client_slot = parsed.body.get("id_slot")
    api = traits(req.routed.api)
    # An Anthropic request names its slot only where every server passes `id_slot` on (llama/upstreams.py).
    takes_slot = api.takes_slot or (api.anthropic and app[UPSTREAMS].messages_slot)
    body, raw = (req.rewrite.body, req.rewrite.raw) if req.rewrite is not None else (parsed.body, req.body)
    tokenizer = service.tokenizer if service is not None else None
    counter = tokenizer if isinstance(tokenizer, CachingTokenizer) else None  # `serve`'s: a cache of counts
    rate = await first_turn_rate(counter, app[ROUTER].knows(session_id), body)
    routed = app[ROUTER].route(
        RouteRequest(
            body=body,
            body_bytes=len(raw),
            session_id=session_id,
            session_turns=turns,
            copy_share=copy_share,
            project=req.project,
            workspace=req.workspace,
            pinned=request.headers.get(PROFILE_HEADER),
            takes_slot=takes_slot,
            client_slot=(
                client_slot
                if isinstance(client_slot, int) and not isinstance(client_slot, bool) and client_slot >= 0
                else None
            ),
            prefill_path=req.routed.upstream_path if api.takes_slot else None,
            chars_per_token=rate,
        )
    )
    if isinstance(routed, Refusal):
        req.refusal, req.profile = routed, routed.decision.profile if routed.decision else req.profile
        return Outcome(routed.status, routed.message, routed.code)
    routed = await carry_out(app[ROUTER], routed)
    req.route, req.profile = routed, routed.profile
    chosen = app[UPSTREAMS].get(routed.profile, routed.replica)
    assert chosen is not None  # the router routes to the table's own profiles and replicas
    req.replica, req.pool_size = chosen.replica, len(app[UPSTREAMS].replicas(chosen.name))
    return chosen


async def carry_out(router: Router, route: Route) -> Route:
    """The KV move a route asks for, carried out through the router's effects and reported back to it (the router
    plans and never waits). A client that goes away meanwhile completes the route: no route reaches the forward."""
    move = route.move
    if move is None or route.handoff is not None or route.remote_prefill is not None:
        return route
    try:
        if isinstance(move, SlotMove):
            return router.moved(route, await router.effects.move_slot(move))
        return router.moved(route, await router.effects.prefill_elsewhere(move))
    except BaseException:
        router.complete(route, Completion(ok=False))
        raise


def _client_gone(req: ProxyRequest, *, stopping: bool) -> Outcome:
    """The client went away (or, while the proxy stops, its handler was ended). One that hangs up right after the
    stream's end marker got the whole answer."""
    if req.meter.complete and req.meter.error is None:
        log.debug("request %s: the client hung up after the end of the answer", req.request_id)
        return SERVED
    if stopping:
        return SHUTDOWN
    log.info("request %s: the client disconnected before the end of the answer", req.request_id)
    return CLIENT_GONE


async def proxy_view(request: web.Request) -> web.StreamResponse:
    app = request.app
    routed = routed_path(request)  # decided on the raw target by the security gate
    req = ProxyRequest(
        uuid.uuid4().hex[:16],
        routed,
        request.headers.get(PROFILE_HEADER) or app[UPSTREAMS].default,
        client=client_name(request.headers.get("User-Agent")),
    )
    lifecycle = app[LIFECYCLE]
    task = asyncio.current_task()
    if task is not None:
        lifecycle.handlers[req.request_id] = task
    try:
        chosen = await _prepare(request, req)
        if isinstance(chosen, Outcome):
            req.outcome = chosen
            refused = answer(chosen)
            refused.headers[REQUEST_ID_HEADER] = req.request_id  # every answer names its record
            return refused
        await before_forward(request, req, chosen)  # warm starts: a stored head restored into the slot (kv/heads/)
        lifecycle.announce(req)
        keepalive = _keepalive(request, req)
        resp, outcome = await _forward_once(request, req, chosen, keepalive)
        while (
            outcome.unreachable
            and (not resp.prepared or (keepalive is not None and keepalive.owns(resp)))  # keep-alives are no answer
            and (other := await _failover(request, req, chosen, outcome))
        ):
            chosen = other
            resp, outcome = await _forward_once(request, req, chosen, keepalive)
        if keepalive is not None and keepalive.owns(resp):  # failed over to no one: the stream ends with the error
            resp = await keepalive.end_with_error(outcome.error or "", outcome.code or "upstream_error")
        req.outcome = _client_gone(req, stopping=lifecycle.stopping) if outcome.client_gone else outcome
        served(request, req, chosen)  # warm starts: learn from the restore, save a new head (kv/heads/)
        if not resp.prepared:
            resp.headers[REQUEST_ID_HEADER] = req.request_id
        return resp
    except (ConnectionResetError, asyncio.CancelledError):
        # aiohttp cancels the handler when the client goes away; forward() has closed the upstream connection.
        # A client that hangs up right after the stream's end marker got the whole answer.
        req.outcome = _client_gone(req, stopping=lifecycle.stopping)
        raise
    except Exception as exc:
        req.outcome = Outcome(500, f"internal error: {exc!r}")
        raise
    finally:
        lifecycle.handlers.pop(req.request_id, None)
        lifecycle.finish(request.method, request.path, req)


def _keepalive(request: web.Request, req: ProxyRequest) -> PrefillKeepAlive | None:
    """Keep-alives for a streamed generating request while the server prefills (requests/keepalive.py)."""
    interval_s = request.app[SETTINGS].prefill_keepalive_s
    if interval_s <= 0 or req.parsed is None or not req.parsed.stream or not traits(req.routed.api).generates:
        return None
    return PrefillKeepAlive(request, req.routed.api, interval_s, {REQUEST_ID_HEADER: req.request_id})


async def _forward_once(
    request: web.Request, req: ProxyRequest, chosen: Upstream, keepalive: PrefillKeepAlive | None = None
) -> tuple[web.StreamResponse, Outcome]:
    app, routed, lifecycle = request.app, req.routed, request.app[LIFECYCLE]
    settings = app[SETTINGS]
    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=settings.connect_timeout_s, sock_read=settings.read_timeout_s
    )
    watched = lifecycle.watched or settings.feed_content
    body, strip = upstream_body(req, chosen, watched)
    if settings.feed_content and req.parsed is not None and req.parsed.stream and traits(routed.api).progress:
        req.meter.live = LiveText()
    return await forward(
        request,
        (app[CLIENT], app[FRESH_CLIENT]),
        chosen,
        path_qs=routed.upstream_path + _upstream_query(request, chosen, routed.api),
        body=body,
        api=routed.api,
        timeout=timeout,
        started=req.started,
        meter=req.meter,
        extra_headers=_extra_headers(req, chosen),
        strip=strip,
        # Nothing to publish per chunk when nobody watched at the start (no per-token timings were asked for).
        progress=(lambda: lifecycle.progress(req)) if watched else None,
        shutting_down=lambda: lifecycle.stopping,
        keepalive=keepalive,
        stranded=app[STRANDED],
    )
