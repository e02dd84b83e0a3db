"""The request handler: read and check the body, find the session, route it (and hand its KV over when it moves),
forward it upstream; the request's lifecycle (`requests/lifecycle.py`) records how it ended."""

from __future__ import annotations

import asyncio
import logging
import uuid
from urllib.parse import unquote

import aiohttp
import orjson
from aiohttp import web

from adaptive_spec.access.rules import KEY_PARAMETER
from adaptive_spec.common.headers import PROFILE_HEADER, REQUEST_ID_HEADER
from adaptive_spec.llama.upstreams import Upstream
from adaptive_spec.requests.accounting import forward_counts, usage_of
from adaptive_spec.requests.apis import sent_as, traits
from adaptive_spec.requests.app_keys import (
    CLIENT,
    FRESH_CLIENT,
    LIFECYCLE,
    MOVER,
    ROUTER,
    SESSIONS,
    SETTINGS,
    SHARED,
    UPSTREAMS,
)
from adaptive_spec.requests.body.compat import repaired
from adaptive_spec.requests.body.parse import ParsedRequest, RoutedPath, parse_body
from adaptive_spec.requests.body.repeats import guard, trailing_repeat
from adaptive_spec.requests.body.shapes import RequestProblem
from adaptive_spec.requests.body.token_rate import first_turn_rate
from adaptive_spec.requests.body.values import Prepared, Received, Rewrite
from adaptive_spec.requests.carry_out import carry_out
from adaptive_spec.requests.error_responses import answer
from adaptive_spec.requests.forwarding.forward import Forwarding, Via, forward
from adaptive_spec.requests.forwarding.keepalive import PrefillKeepAlive
from adaptive_spec.requests.forwarding.outcome import CLIENT_GONE, NOT_ANSWERED, SERVED, SHUTDOWN, Outcome
from adaptive_spec.requests.forwarding.stranded import STRANDED
from adaptive_spec.requests.gate import routed_path
from adaptive_spec.requests.gemini.request import gemini_target, to_chat
from adaptive_spec.requests.heads import (
    arrived,
    before_forward,
    began,
    forwarded_again,
    moving_kv,
    restorer,
    served,
    views,
)
from adaptive_spec.requests.lifecycle import ProxyRequest, Routed
from adaptive_spec.requests.measured_speeds import measured
from adaptive_spec.requests.outgoing import (
    BodyTooLarge,
    choose_upstream,
    extra_headers,
    read_body,
    upstream_body,
    upstream_path,
    upstream_target,
)
from adaptive_spec.routing.contract import Completion, Refusal, Route, RouteRequest
from adaptive_spec.sessions.agents.clients import client_name
from adaptive_spec.sessions.grouping import explicit_session
from adaptive_spec.sessions.project import workspace_path_from_request
from adaptive_spec.sessions.tokenizers import CachingTokenizer
from adaptive_spec.shared_state.shell import BOOKING_TRIES, must_book
from adaptive_spec.streams.output import LiveText

log = logging.getLogger(__name__)
# A body from this size on (a ~40k-token history) is parsed, grouped and routed in turns with the other streams' chunks.
_LARGE_BODY = 128 * 1024
_READS = ("GET", "HEAD", "OPTIONS")  # a request of these methods uses no slot (/props, /slots, /metrics, /health)


async def _prepare(request: web.Request, req: ProxyRequest) -> Routed | Outcome:
    """Read and check the body, find the session, choose the profile: where it goes, or the refusal to answer."""
    settings = request.app[SETTINGS]
    try:
        raw = await read_body(request, settings.max_body_bytes)
    except BodyTooLarge:
        message = f"request body is larger than the limit of {settings.max_body_bytes} bytes"
        return Outcome(413, message, "request_too_large")
    generating = request.method == "POST" and traits(req.routed.api).generates
    req.received, result = read(request, req.routed, raw) if generating else (Received(raw), None)
    if request.method != "POST" and traits(req.routed.api).translated_to:  # nothing llama-server could answer
        return Outcome(405, f"{request.method} is not allowed here: send the request as a POST", "method_not_allowed")
    if result is None:
        chosen = choose_upstream(request, request.app[UPSTREAMS])
        return _routed(request.app, chosen) if isinstance(chosen, Upstream) else chosen
    if isinstance(result, RequestProblem):
        return Outcome(400, result.message, result.code, result.param)
    large = len(req.body) >= _LARGE_BODY
    if large:  # a long history's parse took a millisecond: other streams' chunks go out before it is grouped
        await asyncio.sleep(0)
    await _recall(request, result)
    req.prepared = prepared = await group(request, req, result)
    if large:  # ... and before it is routed
        await asyncio.sleep(0)
    pinned = choose_upstream(request, request.app[UPSTREAMS]) if request.headers.get(PROFILE_HEADER) else None
    if isinstance(pinned, Outcome):
        return pinned
    req.rewrite = rewrite(request, req, prepared)  # before routing: the server sees what is estimated
    return await route(request, req)


def _routed(app: web.Application, chosen: Upstream, made: Route | None = None) -> Routed:
    return Routed(chosen, len(app[UPSTREAMS].replicas(chosen.name)), made)


def read(request: web.Request, routed: RoutedPath, raw: bytes) -> tuple[Received, ParsedRequest | RequestProblem]:
    """The reading stage: the body as it stands for the request and its parse (or the problem with it). A Gemini body
    is translated into the chat completion llama-server is sent, whose bytes then stand for the request's (routing,
    sessions and the trace read what llama-server reads); one that cannot be is received as the client sent it."""
    target = gemini_target(unquote(routed.upstream_path)) if traits(routed.api).translated_to else None
    if target is None:
        return Received(raw), parse_body(routed.api, raw)
    translated = to_chat(raw, target, sse=request.query.get("alt") == "sse")
    if isinstance(translated, RequestProblem):
        return Received(raw), translated
    chat, call = translated.chat, translated.call
    return Received(orjson.dumps(chat), call), ParsedRequest(chat, call.stream, call.model)


async def _recall(request: web.Request, parsed: ParsedRequest) -> None:
    """With state shared among proxies: what the others served the request's newest replies to, so that a turn
    answered by another proxy joins its session here (a request naming its session needs no lookup)."""
    shared, service = request.app[SHARED], request.app[SESSIONS]
    if shared is None or service is None:
        return
    if explicit_session({k.lower(): v for k, v in request.headers.items()}, parsed.body) is None:
        service.registry.heard(await shared.recall(parsed.body))


async def group(request: web.Request, req: ProxyRequest, parsed: ParsedRequest) -> Prepared:
    """The parsed request with the workspace its agent reveals (scanned once: for the project and the policy), its
    session, its project and their policy (for a pair seen the first time, its files read in a thread: the one place
    a request reads a policy file)."""
    service = request.app[SESSIONS]
    headers = {k.lower(): v for k, v in request.headers.items()}
    if KEY_PARAMETER in request.query:  # Gemini's key in the query: a project key names its project as the header does
        headers.setdefault("x-goog-api-key", request.query[KEY_PARAMETER])
    workspace = workspace_path_from_request(headers, parsed.body)
    assignment, project = None, req.project
    if service is not None:
        assignment, project = service.assign(headers, parsed.body, req.routed.project, workspace)
    policies = request.app[ROUTER].policies
    if policies.known(project, workspace):
        return Prepared(parsed, workspace, assignment, project, policies.policy_for(project, workspace))
    return Prepared(parsed, workspace, assignment, project, await asyncio.to_thread(policies.load, project, workspace))


def rewrite(request: web.Request, req: ProxyRequest, prepared: Prepared) -> Rewrite | None:
    """The body to send upstream when it is not the client's: a shape llama-server refuses rewritten, an agent's
    loop on one tool call broken. The router estimates and places that body (it is what the server's cache will
    hold); the client's body still goes to the session statistics."""
    api, body = sent_as(req.routed.api), prepared.parsed.body  # a translated body's rules are its new API's
    fixed = repaired(api, body)
    if fixed is not None:
        body = fixed.body
        log.info("request %s: %s", req.request_id, fixed.note)
    repeat = trailing_repeat(api, body)
    guarded = None
    if repeat is not None:
        agents = prepared.policy.agents
        guarded = guard(api, body, repeat, agents.repeat_note_after, agents.repeat_text_after)
        if guarded is not None:
            body = guarded.body
            log.info("request %s: %s", req.request_id, guarded.describe())
    if fixed is None and guarded is None:
        return None
    return Rewrite(body, orjson.dumps(body), fixed.note if fixed is not None else None, guarded)


async def _failover(request: web.Request, req: ProxyRequest, failed: Routed, outcome: Outcome) -> Routed | None:
    """`failed` refused the connection, or stopped answering and the request was ended (nothing came back): mark it
    down (the health watch brings it back) and, in a pool, route the request again among the replicas still up. A
    session whose KV lived there is re-placed and re-prefills. None: no other replica is up, the refusal stands (this
    request's 503; the replica is marked down all the same, so the next request gets a 503 at once instead of trying
    it again)."""
    table, up = request.app[UPSTREAMS], failed.upstream
    if table.replica_down_reason(up.name, up.replica) is None:  # the health poll may have said so first
        why = "refused connections" if outcome.code == "upstream_unreachable" else "stopped answering"
        table.mark_down(up.name, why, up.replica, watch=True)
    if failed.pool_size <= 1:
        return None
    if not any(table.replica_down_reason(up.name, u.replica) is None for u in table.replicas(up.name)):
        return None
    log.warning("request %s: nothing came back from %s; trying another replica", req.request_id, up.label)
    if failed.route is None:
        chosen = choose_upstream(request, table, up.name)
        return _routed(request.app, chosen) if isinstance(chosen, Upstream) else None
    # Its load comes off the refused replica; nothing was served, nothing is learned. Where it went stays, for the
    # record, if it is refused now.
    request.app[ROUTER].complete(failed.route, Completion(ok=False))
    req.to = Routed(up, failed.pool_size)
    routed = await route(request, req)
    return routed if isinstance(routed, Routed) else None


async def route(request: web.Request, req: ProxyRequest) -> Routed | Outcome:
    """A generating request: the router decides its profile, replica and slot, and moves the session's KV for it."""
    app, prepared = request.app, req.prepared
    assert prepared is not None
    parsed = prepared.parsed
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
    rate = await first_turn_rate(counter, app[ROUTER].measured_chars(session_id), body)
    await measured(app)  # the speeds at start: the request would wait behind their measurement anyway
    heads, blocks = await views(request, req, body)  # the stored heads it may get restored, for the router to decide
    asked = RouteRequest(
        body=body,
        body_bytes=len(raw),
        session_id=session_id,
        session_turns=turns,
        copy_share=copy_share,
        project=req.project,
        workspace=req.workspace,
        policy=prepared.policy,
        pinned=request.headers.get(PROFILE_HEADER),
        takes_slot=takes_slot,
        client_slot=(
            client_slot
            if isinstance(client_slot, int) and not isinstance(client_slot, bool) and client_slot >= 0
            else None
        ),
        prefill_path=upstream_path(req.routed) if api.takes_slot else None,
        chars_per_token=rate,
        heads=heads,
        head_blocks=blocks,
    )
    routed = await _route_shared(app, asked, req.request_id)
    if isinstance(routed, Refusal):
        req.refusal = routed
        return Outcome(routed.status, routed.message, routed.code)
    first = arrived(request, req, routed)  # its session's first request on that server: a head may be restored
    async with moving_kv(app, routed):  # inside the head store's accounting: its lock, the filled slot counted
        routed = await carry_out(app[ROUTER], app[MOVER], routed, restorer(app) if first else None)
    if first:
        began(request, req, routed.restored)
    chosen = app[UPSTREAMS].get(routed.profile, routed.replica)
    assert chosen is not None  # the router routes to the table's own profiles and replicas
    return _routed(app, chosen, routed)


async def _route_shared(app: web.Application, asked: RouteRequest, request_id: str) -> Route | Refusal:
    """`route()`, with state shared among proxies: what the others did read first, the slot booked after; a slot
    another proxy took meanwhile is routed again (the last try books it all the same, as one proxy queues a request
    when every slot is busy)."""
    router, shared = app[ROUTER], app[SHARED]
    if shared is None:
        return router.route(asked)
    for attempt in range(BOOKING_TRIES):
        seen = await shared.before_route(router, asked.session_id)
        routed = router.route(asked)
        if isinstance(routed, Refusal):
            return routed
        try:
            booked = await shared.book(router, routed, request_id, must_book(router, routed, attempt), seen)
        except BaseException:  # the client went away: no route reaches the forward uncompleted
            router.complete(routed, Completion(ok=False))
            raise
        if booked:
            return routed
        router.withdraw(routed)
    raise AssertionError("the last try books the slot")


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
        client=client_name(request.headers.get("User-Agent"), request.headers),
    )
    lifecycle = app[LIFECYCLE]
    task = asyncio.current_task()
    if task is not None:
        lifecycle.handlers[req.request_id] = task
    outcome = NOT_ANSWERED
    try:
        resp, outcome = await _handle(request, req)
        return resp
    except (ConnectionResetError, asyncio.CancelledError):
        # aiohttp cancels the handler when the client goes away; forward() has closed the upstream connection.
        # A client that hangs up right after the stream's end marker got the whole answer.
        outcome = _client_gone(req, stopping=lifecycle.stopping)
        raise
    except Exception as exc:
        outcome = Outcome(500, f"internal error: {exc!r}")
        raise
    finally:
        lifecycle.handlers.pop(req.request_id, None)
        lifecycle.finish(request.method, request.path, req, outcome)


async def _handle(request: web.Request, req: ProxyRequest) -> tuple[web.StreamResponse, Outcome]:
    """The request's stages in their order: prepared and routed (`_prepare`: a `Routed`, or the refusal), sent
    (`_forward_once`, again on another replica after a failover), served (the head store learns); the answer and
    how the request ended."""
    lifecycle = request.app[LIFECYCLE]
    try:
        to = await _prepare(request, req)
    except asyncio.CancelledError:
        # Ended by the shutdown before it was forwarded (waiting behind the speed measurement at start, a KV move,
        # a slot booking): told so, as one ended at the server is, not left without an answer.
        if not lifecycle.stopping or (task := asyncio.current_task()) is None:
            raise
        task.uncancel()
        to = SHUTDOWN
    if isinstance(to, Outcome):
        refused = answer(to)
        refused.headers[REQUEST_ID_HEADER] = req.request_id  # every answer names its record
        return refused, to
    req.to = to
    before_forward(request, req, to.upstream)  # counted by the head store: a save waiting on its slot is dropped
    lifecycle.announce(req)
    keepalive = _keepalive(request, req)
    resp, outcome = await _forward_once(request, req, to.upstream, keepalive)
    while (
        outcome.unreachable
        and (not resp.prepared or (keepalive is not None and keepalive.owns(resp)))  # keep-alives are no answer
        and (other := await _failover(request, req, to, outcome))
    ):
        req.to = to = other
        forwarded_again(request, req, to.upstream)  # counted by the head store as any forward
        resp, outcome = await _forward_once(request, req, to.upstream, keepalive)
    if keepalive is not None and keepalive.owns(resp):  # failed over to no one: the stream ends with the error
        resp = await keepalive.end_with_error(outcome.error or "", outcome.code or "upstream_error")
    outcome = _client_gone(req, stopping=lifecycle.stopping) if outcome.client_gone else outcome
    served(request, req, to.upstream, outcome)  # warm starts: learn from the restore, save a new head (kv/heads/)
    if not resp.prepared:
        resp.headers[REQUEST_ID_HEADER] = req.request_id
    return resp, outcome


def _keepalive(request: web.Request, req: ProxyRequest) -> PrefillKeepAlive | None:
    """Keep-alives for a streamed generating request while the server prefills (requests/forwarding/keepalive.py)."""
    interval_s = request.app[SETTINGS].prefill_keepalive_s
    if interval_s <= 0 or req.parsed is None or not req.parsed.stream or not traits(req.routed.api).generates:
        return None
    if req.gemini is not None and not req.gemini.sse:  # a JSON array stream has no room for a keep-alive
        return None
    return PrefillKeepAlive(request, req.routed.api, interval_s, {REQUEST_ID_HEADER: req.request_id})


async def _forward_once(
    request: web.Request, req: ProxyRequest, chosen: Upstream, keepalive: PrefillKeepAlive | None = None
) -> tuple[web.StreamResponse, Outcome]:
    """The sending stage: the body sent (a `Sent`, from `upstream_body`) and the one `Forwarding` made of it,
    forwarded, its answer filling the meter this stage begins in the request's tally (`req.forwards`); what
    llama-server counted for it booked whatever happened (`requests/accounting.py`)."""
    app, routed, lifecycle, settings = request.app, req.routed, request.app[LIFECYCLE], request.app[SETTINGS]
    watched = lifecycle.watched or settings.feed_content
    sent = upstream_body(req, chosen, watched)
    live = settings.feed_content and req.parsed is not None and req.parsed.stream and traits(routed.api).progress
    meter = req.forwards.begin(sent, LiveText() if live else None)
    shared = app[SHARED]
    if shared is not None and req.route is None and request.method not in _READS:
        # Booked no slot (not routed), yet it may use one: counted for the head stores' guards of every proxy.
        await shared.forwarded(chosen.base_url)
    await lifecycle.accounting.before_forward(app[CLIENT], chosen.base_url)
    lifecycle.accounting.forwarded(chosen.base_url)
    outcome: Outcome | None = None
    try:
        reading = settings.read_timeout_s
        out = Forwarding(
            upstream=chosen,
            path_qs=upstream_target(request, chosen, routed),
            body=sent.body,
            api=routed.api,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=settings.connect_timeout_s, sock_read=reading),
            started=req.started,
            extra_headers=extra_headers(req, chosen),
            strip=sent.strip,
            gemini=req.gemini,
        )
        # Nothing to publish per chunk when nobody watched at the start (no per-token timings were asked for).
        progress = (lambda: lifecycle.progress(req)) if watched else None
        via = Via((app[CLIENT], app[FRESH_CLIENT]), keepalive, progress, lambda: lifecycle.stopping, app[STRANDED])
        resp, outcome = await forward(request, out, meter, via)
        return resp, outcome
    finally:
        counted, known = forward_counts(traits(routed.api).generates, meter, outcome), usage_of(meter.timings)
        req.forwards.ended(lifecycle.accounting.ended(app[CLIENT], chosen.base_url, req.request_id, counted, known))
