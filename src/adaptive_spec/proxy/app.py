"""The aiohttp application: routes, body limits, profile choice, and one record per request."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import quote

import aiohttp
import orjson
from aiohttp import web

from adaptive_spec.core.history import RequestHistory
from adaptive_spec.core.project import DEFAULT_PROJECT
from adaptive_spec.core.records import RequestRecord
from adaptive_spec.core.requests import GENERATING_APIS, ParsedRequest, RequestProblem, parse_body, split_path
from adaptive_spec.core.sessions import SessionAssignment
from adaptive_spec.core.timings import ResponseMeter
from adaptive_spec.proxy.errors import error_response
from adaptive_spec.proxy.forward import Outcome, forward
from adaptive_spec.proxy.stats import SessionService, run_worker
from adaptive_spec.proxy.upstreams import Upstream, UpstreamTable

PROFILE_HEADER = "x-adaptive-spec-profile"


@dataclass(frozen=True, slots=True)
class ProxySettings:
    max_body_bytes: int = 32 * 1024 * 1024
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 600.0  # the longest silence allowed between two chunks of a response
    history_size: int = 1000


class BodyTooLarge(Exception):
    pass


HISTORY = web.AppKey("history", RequestHistory)
UPSTREAMS = web.AppKey("upstreams", UpstreamTable)
SETTINGS = web.AppKey("settings", ProxySettings)
CLIENT = web.AppKey("client", aiohttp.ClientSession)
SESSIONS: web.AppKey[SessionService | None] = web.AppKey("sessions")


def build_app(
    upstreams: UpstreamTable, settings: ProxySettings, sessions: SessionService | None = None
) -> web.Application:
    # The body limit is enforced by read_body (to answer in the OpenAI error shape), not by aiohttp.
    app = web.Application(client_max_size=settings.max_body_bytes + 1)
    app[UPSTREAMS] = upstreams
    app[SETTINGS] = settings
    app[HISTORY] = RequestHistory(settings.history_size)
    app[SESSIONS] = sessions
    app.cleanup_ctx.append(_client_session)
    app.cleanup_ctx.append(_session_worker)
    app.router.add_get("/adaptive/requests", _requests_view)
    app.router.add_get("/adaptive/health", _health_view)
    app.router.add_get("/adaptive/sessions", _sessions_view)
    app.router.add_route("*", "/{tail:.*}", _proxy_view)
    return app


async def _client_session(app: web.Application) -> AsyncIterator[None]:
    # No connection limit (each request holds one for its whole stream) and no decompression (bytes pass as sent).
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
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


async def _sessions_view(request: web.Request) -> web.Response:
    service = request.app[SESSIONS]
    if service is None:
        return error_response(404, "session tracking is off", code="sessions_off")
    if request.query.get("drain") == "1":  # wait for pending updates: handy for tests and scripts
        await service.drain()
    return web.Response(body=orjson.dumps(service.to_json()), content_type="application/json")


async def _requests_view(request: web.Request) -> web.Response:
    limit_text = request.query.get("limit")
    limit = int(limit_text) if limit_text and limit_text.isdigit() else None
    history = request.app[HISTORY]
    records = [r.to_json() for r in history.latest(limit)]
    body = orjson.dumps({"total": history.total, "requests": records})
    return web.Response(body=body, content_type="application/json")


async def _health_view(request: web.Request) -> web.Response:
    table = request.app[UPSTREAMS]
    profiles = {
        name: {"up": table.down_reason(name) is None, "reason": table.down_reason(name)} for name in table.names()
    }
    return web.Response(body=orjson.dumps({"profiles": profiles}), content_type="application/json")


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


def choose_upstream(request: web.Request, table: UpstreamTable) -> Upstream | web.Response:
    """The profile a request goes to: the one its header pins, else the default."""
    name = request.headers.get(PROFILE_HEADER) or table.default
    upstream = table.get(name)
    if upstream is None:
        known = ", ".join(table.names())
        return error_response(
            400,
            f"unknown profile {name!r} in {PROFILE_HEADER}; known profiles: {known}",
            code="unknown_profile",
            param=PROFILE_HEADER,
        )
    reason = table.down_reason(name)
    if reason is not None:
        return error_response(
            503, f"profile {name!r} at {upstream.base_url} is down: {reason}", code="profile_unavailable"
        )
    return upstream


def _upstream_body(body: bytes, parsed: ParsedRequest | None, upstream: Upstream) -> bytes:
    """The client's bytes, unless a router-mode profile needs its preset named in `model`."""
    if upstream.upstream_model is None or parsed is None or parsed.model == upstream.upstream_model:
        return body
    return orjson.dumps({**parsed.body, "model": upstream.upstream_model})


def _upstream_query(request: web.Request, upstream: Upstream, api: str) -> str:
    """Router-mode servers take the preset as `?model=` on GET endpoints such as /props and /slots."""
    qs = request.query_string
    if (
        upstream.upstream_model is not None
        and request.method == "GET"
        and api == "other"
        and "model" not in request.query
    ):
        extra = "model=" + quote(upstream.upstream_model, safe="")
        qs = f"{qs}&{extra}" if qs else extra
    return f"?{qs}" if qs else ""


async def _proxy_view(request: web.Request) -> web.StreamResponse:
    started = time.perf_counter()
    started_unix = time.time()
    request_id = uuid.uuid4().hex[:16]
    routed = split_path(request.path)
    settings = request.app[SETTINGS]
    table = request.app[UPSTREAMS]
    profile = request.headers.get(PROFILE_HEADER) or table.default
    parsed: ParsedRequest | None = None
    outcome: Outcome | None = None
    meter = ResponseMeter()
    service = request.app[SESSIONS]
    assignment: SessionAssignment | None = None
    project = routed.project or DEFAULT_PROJECT
    status = 500
    error: str | None = "the proxy stopped before the request was answered"
    try:
        try:
            body = await read_body(request, settings.max_body_bytes)
        except BodyTooLarge:
            status, error = 413, f"request body is larger than the limit of {settings.max_body_bytes} bytes"
            return error_response(413, error, code="request_too_large")
        if request.method == "POST" and routed.api in GENERATING_APIS:
            result = parse_body(routed.api, body)
            if isinstance(result, RequestProblem):
                status, error = 400, result.message
                return error_response(400, result.message, code=result.code, param=result.param)
            parsed = result
            if service is not None:
                headers = {k.lower(): v for k, v in request.headers.items()}
                assignment, project = service.assign(headers, parsed.body, routed.project)
        chosen = choose_upstream(request, table)
        if isinstance(chosen, web.Response):
            status, error = chosen.status, (chosen.text or "")[:300]
            return chosen
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=settings.connect_timeout_s, sock_read=settings.read_timeout_s
        )
        resp, outcome = await forward(
            request,
            request.app[CLIENT],
            chosen,
            path_qs=routed.upstream_path + _upstream_query(request, chosen, routed.api),
            body=_upstream_body(body, parsed, chosen),
            api=routed.api,
            timeout=timeout,
            started=started,
            extra_headers={"x-adaptive-spec-request-id": request_id, PROFILE_HEADER: chosen.name},
            meter=meter,
        )
        status, error = outcome.status, outcome.error
        return resp
    except (ConnectionResetError, asyncio.CancelledError):
        # aiohttp cancels the handler when the client goes away; forward() has closed the upstream connection.
        # A client that hangs up right after the stream's end marker got the whole answer.
        status, error = (200, None) if meter.complete else (499, "the client disconnected")
        raise
    except Exception as exc:
        status, error = 500, f"internal error: {exc!r}"
        raise
    finally:
        finished = error is None and status < 400
        if finished and service is not None and assignment is not None and parsed is not None:
            service.finished(assignment, project, parsed.body, meter.output)
        request.app[HISTORY].add(
            RequestRecord(
                request_id=request_id,
                started_at_unix=started_unix,
                method=request.method,
                path=request.path,
                api=routed.api,
                project=project,
                session_id=assignment.session_id if assignment else None,
                session_source=assignment.source if assignment else None,
                profile=profile,
                stream=parsed.stream if parsed is not None else False,
                status=status,
                outcome="finished" if finished else "failed",
                error=error,
                timings=meter.timings,
                ttft_ms=meter.first_token_ms,
                ttst_ms=meter.second_token_ms,
                total_ms=(time.perf_counter() - started) * 1000.0,
            )
        )
