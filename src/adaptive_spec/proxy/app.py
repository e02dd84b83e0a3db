"""The aiohttp application: body limits, profile choice, forwarding, and exactly one record and one
finished-or-failed event per request."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from urllib.parse import quote

import aiohttp
import orjson
from aiohttp import web

from adaptive_spec.core.access import AccessPolicy, with_model
from adaptive_spec.core.events import (
    DraftProgress,
    ProfileDown,
    ProfileUp,
    RequestFailed,
    RequestFinished,
    RequestStarted,
)
from adaptive_spec.core.history import RequestHistory
from adaptive_spec.core.profiles import ProfileInfo
from adaptive_spec.core.project import DEFAULT_PROJECT, workspace_path_from_request
from adaptive_spec.core.records import RequestRecord, Timings
from adaptive_spec.core.requests import (
    GENERATING_APIS,
    ParsedRequest,
    RequestProblem,
    RoutedPath,
    parse_body,
)
from adaptive_spec.core.route import Decision
from adaptive_spec.core.sessions import SessionAssignment
from adaptive_spec.core.timings import ResponseMeter, without_progress_timings
from adaptive_spec.proxy.bus import EventBus
from adaptive_spec.proxy.control import add_control_views
from adaptive_spec.proxy.errors import error_response
from adaptive_spec.proxy.forward import forward
from adaptive_spec.proxy.metrics import ProxyMetrics
from adaptive_spec.proxy.routing import FixedPolicy, HandoffResult, Router
from adaptive_spec.proxy.security import install_security, routed_path
from adaptive_spec.proxy.state import (
    BUS,
    CLIENT,
    HISTORY,
    METRICS,
    PROFILE_HEADER,
    PROFILES,
    RESTART,
    ROUTER,
    SESSIONS,
    SETTINGS,
    TRACE,
    UPSTREAMS,
    ProxySettings,
)
from adaptive_spec.proxy.stats import SessionService, run_worker
from adaptive_spec.proxy.trace import TraceWriter
from adaptive_spec.proxy.upstreams import Upstream, UpstreamTable
from adaptive_spec.proxy.views import add_views

__all__ = ["PROFILE_HEADER", "ProxySettings", "build_app"]
log = logging.getLogger(__name__)
# APIs whose streams llama-server can annotate with per-token timings (for the live draft progress).
_PROGRESS_APIS = frozenset({"chat", "completions"})
ROUTE_HEADER = "x-adaptive-spec-route"
# APIs whose body llama-server passes `id_slot` on from (its Anthropic and Responses conversions rebuild the body).
_SLOT_APIS = frozenset({"chat", "completions"})
_POLICY_REFRESH_S = 2.0
# How long a request waits for its session's previous turn to be folded into the statistics it is routed on.
_SETTLE_S = 0.3


class BodyTooLarge(Exception):
    pass


def build_app(
    upstreams: UpstreamTable,
    settings: ProxySettings,
    sessions: SessionService | None = None,
    *,
    bus: EventBus | None = None,
    trace: TraceWriter | None = None,
    profiles: list[ProfileInfo] | None = None,
    router: Router | None = None,
    restart: Callable[[str], Awaitable[None]] | None = None,
    access: AccessPolicy | None = None,
) -> web.Application:
    # The body limit is enforced by read_body (to answer in the OpenAI error shape), not by aiohttp.
    app = web.Application(client_max_size=settings.max_body_bytes + 1)
    install_security(app, access or AccessPolicy())  # every route, later ones included
    app[UPSTREAMS], app[SETTINGS], app[SESSIONS], app[TRACE] = upstreams, settings, sessions, trace
    app[HISTORY] = RequestHistory(settings.history_size)
    app[BUS] = bus or EventBus()
    app[METRICS] = ProxyMetrics(frozenset(upstreams.names()))
    app[PROFILES] = profiles or []
    if router is None:
        infos = {i.name: i for i in app[PROFILES]}
        router = Router(upstreams, FixedPolicy(), {n: i.total_slots for n, i in infos.items()},
                        {n: i.spec_types for n, i in infos.items()})  # fmt: skip
    router.publish = app[BUS].publish
    app[ROUTER] = router
    app[RESTART] = restart
    app[BUS].listen(app[METRICS].on_event)
    upstreams.on_change = lambda u, reason: app[BUS].publish(
        ProfileUp(profile=u.name, base_url=u.base_url)
        if reason is None
        else ProfileDown(profile=u.name, base_url=u.base_url, reason=reason)
    )
    for name in upstreams.names():
        app[METRICS].profile_up.labels(name).set(0 if upstreams.down_reason(name) else 1)
    if sessions is not None:
        sessions.publish = app[BUS].publish
    app.cleanup_ctx.append(_client_session)
    app.cleanup_ctx.append(_session_worker)
    app.cleanup_ctx.append(_policy_refresher)
    app.on_shutdown.append(_close_feeds)
    add_views(app, _proxy_view)
    add_control_views(app)
    app.router.add_route("*", "/{tail:.*}", _proxy_view)
    return app


async def _close_feeds(app: web.Application) -> None:
    app[BUS].close_all()  # event feeds end before the server stops waiting for its handlers


async def _client_session(app: web.Application) -> AsyncIterator[None]:
    # No connection limit (each request holds one for its whole stream) and no decompression (bytes pass as sent).
    # Idle connections are dropped after 2 s, before llama-server's own keep-alive timeout (5 s) closes them under us.
    connector = aiohttp.TCPConnector(limit=0, force_close=False, keepalive_timeout=2.0)
    async with aiohttp.ClientSession(connector=connector, auto_decompress=False) as session:
        app[CLIENT] = session
        yield


async def _session_worker(app: web.Application) -> AsyncIterator[None]:
    service = app[SESSIONS]
    task = asyncio.create_task(run_worker(service)) if service is not None else None
    yield
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    trace = app[TRACE]
    if trace is not None:
        trace.close()


async def _policy_refresher(app: web.Application) -> AsyncIterator[None]:
    """Reload changed policy files every 2 s (a bad file keeps the last good policy; the router says so)."""

    async def loop() -> None:
        while True:
            await asyncio.sleep(_POLICY_REFRESH_S)
            try:
                app[ROUTER].announce(await asyncio.to_thread(app[ROUTER].refresh_policies))
                await asyncio.to_thread(app[ROUTER].sweep_slot_files)
            except Exception:
                log.exception("policy refresh failed")

    task = asyncio.create_task(loop())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


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


def choose_upstream(request: web.Request, table: UpstreamTable, name: str | None = None) -> Upstream | web.Response:
    """The upstream of profile `name` (default: the one the header pins, else the default), or the error to answer."""
    name = name or request.headers.get(PROFILE_HEADER) or table.default
    upstream = table.get(name)
    if upstream is None:
        known = ", ".join(table.names())
        return error_response(400, f"unknown profile {name!r} in {PROFILE_HEADER}; known profiles: {known}",
                              code="unknown_profile", param=PROFILE_HEADER)  # fmt: skip
    reason = table.down_reason(name)
    if reason is not None:
        return error_response(503, f"profile {name!r} at {upstream.base_url} is down: {reason}",
                              code="profile_unavailable")  # fmt: skip
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


@dataclass
class _Request:
    """One request's own state while it is handled (never shared between tasks)."""

    request_id: str
    routed: RoutedPath
    profile: str
    started: float = field(default_factory=time.perf_counter)
    started_unix: float = field(default_factory=time.time)
    body: bytes = b""
    parsed: ParsedRequest | None = None
    assignment: SessionAssignment | None = None
    project: str = DEFAULT_PROJECT
    status: int = 500
    error: str | None = "the proxy stopped before the request was answered"
    announced: bool = False
    meter: ResponseMeter = field(default_factory=ResponseMeter)
    last_progress: tuple[float, Timings | None] = (0.0, None)
    workspace: str | None = None  # the workspace path the agent reveals, if any
    decision: Decision | None = None
    slot: int | None = None  # the slot named with id_slot (profiles with several slots)
    handoff: HandoffResult | None = None
    routed_started: bool = False  # counted in the router's in-flight load


def _upstream_body(req: _Request, upstream: Upstream) -> tuple[bytes, bool]:
    """The bytes to send: the client's, unless a router preset must be named or per-token timings are wanted.

    Returns (body, strip): strip says the client did not ask for per-token timings, so they are removed again.
    """
    parsed = req.parsed
    if parsed is None:
        preset = upstream.upstream_model
        return (with_model(req.body, preset) if preset is not None and req.body else req.body), False
    changes: dict[str, object] = {}
    if upstream.upstream_model is not None and parsed.model != upstream.upstream_model:
        changes["model"] = upstream.upstream_model
    strip = parsed.stream and req.routed.api in _PROGRESS_APIS and "timings_per_token" not in parsed.body
    if strip:
        changes["timings_per_token"] = True
    if req.slot is not None and "id_slot" not in parsed.body:
        changes["id_slot"] = req.slot
    return (orjson.dumps({**parsed.body, **changes}) if changes else req.body), strip


def _extra_headers(req: _Request, chosen: Upstream) -> dict[str, str]:
    """Sent upstream and back to the client: which request this is, the profile that served it, and why."""
    headers = {"x-adaptive-spec-request-id": req.request_id, PROFILE_HEADER: chosen.name}
    if req.decision is not None:
        headers[ROUTE_HEADER] = req.decision.kind
    return headers


def _announce(app: web.Application, req: _Request) -> None:
    if req.announced:
        return
    req.announced = True
    a, d = req.assignment, req.decision
    app[BUS].publish(
        RequestStarted(
            request_id=req.request_id, api=req.routed.api, project=req.project, profile=req.profile,
            session_id=a.session_id if a else None, session_source=a.source if a else None,
            stream=req.parsed.stream if req.parsed else False, route=d.kind if d else None,
            reason=d.reason if d else None, moved_from=d.moved_from if d else None,
        )
    )  # fmt: skip


def _progress(app: web.Application, req: _Request) -> None:
    """After each relayed chunk: publish the running draft totals, at most once per interval."""
    timings = req.meter.timings
    last_at, last = req.last_progress
    now = time.monotonic()
    if timings is None or timings is last or now - last_at < app[SETTINGS].progress_interval_s:
        return
    req.last_progress = (now, timings)
    app[BUS].publish(
        DraftProgress(
            request_id=req.request_id, profile=req.profile, predicted_n=timings.predicted_n, draft_n=timings.draft_n,
            draft_n_accepted=timings.draft_n_accepted, predicted_per_second=timings.predicted_per_second,
        )
    )  # fmt: skip


async def _prepare(request: web.Request, req: _Request) -> Upstream | web.Response:
    """Read and check the body, find the session, choose the profile: an upstream, or an error to answer with."""
    settings = request.app[SETTINGS]
    try:
        req.body = await read_body(request, settings.max_body_bytes)
    except BodyTooLarge:
        req.status, req.error = 413, f"request body is larger than the limit of {settings.max_body_bytes} bytes"
        return error_response(413, req.error, code="request_too_large")
    if request.method == "POST" and req.routed.api in GENERATING_APIS:
        result = parse_body(req.routed.api, req.body)
        if isinstance(result, RequestProblem):
            req.status, req.error = 400, result.message
            return error_response(400, result.message, code=result.code, param=result.param)
        req.parsed = result
        service = request.app[SESSIONS]
        headers = {k.lower(): v for k, v in request.headers.items()}
        req.workspace = workspace_path_from_request(headers, result.body)  # scanned once: project and policy
        if service is not None:
            req.assignment, req.project = service.assign(headers, result.body, req.routed.project, req.workspace)
        pinned = choose_upstream(request, request.app[UPSTREAMS]) if request.headers.get(PROFILE_HEADER) else None
        if isinstance(pinned, web.Response):
            req.status, req.error = pinned.status, (pinned.text or "")[:300]
            return pinned
        return await _route(request, req)
    chosen = choose_upstream(request, request.app[UPSTREAMS])
    if isinstance(chosen, web.Response):
        req.status, req.error = chosen.status, (chosen.text or "")[:300]
    return chosen


async def _route(request: web.Request, req: _Request) -> Upstream | web.Response:
    """A generating request: decide its profile, and hand the session's KV over when it moves."""
    app, parsed = request.app, req.parsed
    assert parsed is not None
    router, service, a = app[ROUTER], app[SESSIONS], req.assignment
    session_id = a.session_id if a is not None else None
    turns, copy = 0, None
    if service is not None and session_id is not None:
        await service.settled(session_id, _SETTLE_S)
        turns, copy = service.copy_state(session_id)
    req.decision, _ = router.choose(
        body=parsed.body, body_bytes=len(req.body), session_id=session_id, session_turns=turns, copy_share=copy,
        project=req.project, workspace=req.workspace,
        pinned=request.headers.get(PROFILE_HEADER),
    )  # fmt: skip
    req.profile = req.decision.profile
    chosen = choose_upstream(request, app[UPSTREAMS], req.profile)
    if isinstance(chosen, web.Response):
        req.status, req.error = chosen.status, (chosen.text or "")[:300]
        return chosen
    client_slot = parsed.body.get("id_slot")
    if isinstance(client_slot, int) and not isinstance(client_slot, bool) and client_slot >= 0:
        req.slot = client_slot  # the client chose; the router follows it
    elif req.routed.api in _SLOT_APIS:
        req.slot = router.slot_for(chosen.name, session_id)
    router.started(chosen.name, req.slot)
    req.routed_started = True
    if req.decision.handoff and session_id is not None:
        req.handoff = await router.hand_off(app[CLIENT], req.decision, session_id, req.slot)
    return chosen


async def _proxy_view(request: web.Request) -> web.StreamResponse:
    app = request.app
    routed = routed_path(request)  # decided on the raw target by the security gate
    req = _Request(uuid.uuid4().hex[:16], routed, request.headers.get(PROFILE_HEADER) or app[UPSTREAMS].default,
                   project=routed.project or DEFAULT_PROJECT)  # fmt: skip
    try:
        chosen = await _prepare(request, req)
        if isinstance(chosen, web.Response):
            return chosen
        _announce(app, req)
        settings = app[SETTINGS]
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=settings.connect_timeout_s,
                                        sock_read=settings.read_timeout_s)  # fmt: skip
        body, strip = _upstream_body(req, chosen)
        resp, outcome = await forward(
            request, app[CLIENT], chosen,
            path_qs=routed.upstream_path + _upstream_query(request, chosen, routed.api), body=body, api=routed.api,
            timeout=timeout, started=req.started, meter=req.meter,
            extra_headers=_extra_headers(req, chosen),
            rewrite=without_progress_timings if strip else None, progress=lambda: _progress(app, req),
        )  # fmt: skip
        req.status, req.error = outcome.status, outcome.error
        return resp
    except (ConnectionResetError, asyncio.CancelledError):
        # aiohttp cancels the handler when the client goes away; forward() has closed the upstream connection.
        # A client that hangs up right after the stream's end marker got the whole answer.
        req.status, req.error = (200, None) if req.meter.complete else (499, "the client disconnected")
        raise
    except Exception as exc:
        req.status, req.error = 500, f"internal error: {exc!r}"
        raise
    finally:
        _finish(app, request.method, request.path, req)


def _finish(app: web.Application, method: str, path: str, req: _Request) -> None:
    finished = req.error is None and req.status < 400
    service, a, meter, d = app[SESSIONS], req.assignment, req.meter, req.decision
    if req.routed_started and d is not None:  # first: the profile's load must come down whatever happens next
        app[ROUTER].finished(d, req.profile, req.slot, a.session_id if a else None, meter.timings, len(req.body),
                             finished)  # fmt: skip
    if finished and service is not None and a is not None and req.parsed is not None:
        service.finished(a, req.project, req.parsed.body, meter.output)
    record = RequestRecord(
        request_id=req.request_id, started_at_unix=req.started_unix, method=method, path=path, api=req.routed.api,
        project=req.project, session_id=a.session_id if a else None, session_source=a.source if a else None,
        subagent=a.subagent if a else False, profile=req.profile,
        stream=req.parsed.stream if req.parsed is not None else False, status=req.status,
        outcome="finished" if finished else "failed", error=req.error, timings=meter.timings,
        ttft_ms=meter.first_token_ms, ttst_ms=meter.second_token_ms,
        total_ms=(time.perf_counter() - req.started) * 1000.0, route=d.kind if d else None,
        reason=d.reason if d else None, moved_from=d.moved_from if d else None,
        handoff=asdict(req.handoff) if req.handoff is not None else None,
    )  # fmt: skip
    app[HISTORY].add(record)
    if d is not None:
        app[ROUTER].remember({"request_id": req.request_id, "session_id": record.session_id, "profile": req.profile,
                              "route": d.kind, "reason": d.reason, "status": req.status})  # fmt: skip
    as_json = record.to_json()
    _announce(app, req)
    app[BUS].publish(RequestFinished(record=as_json) if finished else RequestFailed(record=as_json))
    trace = app[TRACE]
    if trace is not None and req.routed.api in GENERATING_APIS:
        try:
            trace.request(as_json, req.body, meter.output.text if trace.content else None)
        except (OSError, ValueError):
            log.exception("could not write the trace line for request %s", req.request_id)
