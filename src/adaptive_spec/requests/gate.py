"""The gate every request passes, whatever route answers it (routes added later included): Host allow-list, the request
path decided once, CORS, the API key, foreign origins and form posts, llama-server's control endpoints; and
errors in Anthropic's shape for /v1/messages clients and in Google's for Gemini's.

Also keeps a flood of malformed HTTP out of the log."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import http_exceptions, web

from adaptive_spec.access.rules import (
    KEY_HEADERS,
    KEY_PARAMETER,
    SIMPLE_FORM_TYPES,
    AccessPolicy,
    control_refusal,
    cors_allowed,
    host_allowed,
    key_accepted,
    origin_allowed,
    sent_keys,
)
from adaptive_spec.requests.apis import Api, traits
from adaptive_spec.requests.body.parse import RoutedPath, split_path
from adaptive_spec.requests.body.shapes import RequestProblem
from adaptive_spec.requests.error_responses import as_anthropic, as_google, error_response
from adaptive_spec.requests.paths import decide_path

__all__ = ["ACCESS", "hidden_headers", "install_security", "request_keys", "routed_path"]
ACCESS = web.AppKey("access", AccessPolicy)
_ROUTED = web.RequestKey("routed", RoutedPath)
_HIDDEN: web.RequestKey[tuple[str, ...]] = web.RequestKey("hidden_headers")
_PREFLIGHT = web.RequestKey("preflight", bool)
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_EXPOSED = "x-adaptive-spec-request-id, x-adaptive-spec-profile, x-adaptive-spec-route"
_CORS_MAX_AGE_S = "600"
_BAD_HTTP_LOG_INTERVAL_S = 10.0
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def install_security(app: web.Application, policy: AccessPolicy) -> None:
    app[ACCESS] = policy
    app.middlewares.append(_gate)
    app.on_response_prepare.append(_cors_headers)
    quiet_malformed_http_logs()


def routed_path(request: web.Request) -> RoutedPath:
    """The path the gate decided on (and checked); forwarded as it is."""
    return request[_ROUTED] if _ROUTED in request else split_path(request.path)


def request_keys(request: web.Request) -> list[str]:
    """The keys a request carries, however its client sends one: `Authorization: Bearer`, `x-api-key`, and
    Gemini's `x-goog-api-key` or `?key=`."""
    headers = request.headers
    return sent_keys(
        headers.get("Authorization"),
        headers.get("x-api-key"),
        headers.get("x-goog-api-key"),
        *request.query.getall(KEY_PARAMETER, []),
    )


def hidden_headers(request: web.Request) -> tuple[str, ...]:
    """Request headers not to send on to llama-server (the client's key, when the proxy checks keys itself)."""
    hidden: tuple[str, ...] = request.get(_HIDDEN, ())
    return hidden


@web.middleware
async def _gate(request: web.Request, handler: Handler) -> web.StreamResponse:
    decided = decide_path(request.raw_path)
    # A refused path: an Anthropic or Gemini client still parses only its own error shape.
    api = decided.api if isinstance(decided, RoutedPath) else _refused_api(request.path)
    refusal = _refusal(request, decided)
    if refusal is not None:
        return _shaped(api, refusal)
    try:
        response = await handler(request)
    except web.HTTPException as exc:  # aiohttp's own (405, 413, ...): in the clients' error shape too
        if exc.status < 400:
            raise
        response = error_response(exc.status, exc.reason, code=exc.reason.lower().replace(" ", "_"))
    return _shaped(api, response)


def _refused_api(path: str) -> Api:
    """The API a refused path looks like it was meant for: Anthropic's and Gemini's clients parse only their own
    error shape."""
    if path.rstrip("/").endswith(("/v1/messages", "/count_tokens")):
        return Api.MESSAGES
    return Api.GEMINI if "/v1beta/models" in path else Api.OTHER


def _refusal(request: web.Request, decided: RoutedPath | RequestProblem) -> web.StreamResponse | None:
    policy = request.app[ACCESS]
    headers = request.headers
    if not host_allowed(policy, headers.get("Host")):
        host = headers.get("Host", "")[:100]
        return error_response(
            403,
            f"Host {host!r} is not one this proxy answers to; start it with --allow-host NAME "
            "to add a name clients use",
            code="host_not_allowed",
        )
    if isinstance(decided, RequestProblem):
        return error_response(400, decided.message, code=decided.code)
    request[_ROUTED] = decided
    origin = headers.get("Origin")
    if request.method == "OPTIONS" and origin is not None and "Access-Control-Request-Method" in headers:
        request[_PREFLIGHT] = True
        return _preflight(policy, origin, headers.get("Access-Control-Request-Headers"))
    if request.method not in _SAFE_METHODS and not origin_allowed(policy, origin, headers.get("Host")):
        page = (origin or "")[:100]
        return error_response(
            403,
            f"requests from the web page origin {page!r} are refused; start the proxy with "
            "--cors-origin ORIGIN to allow that page",
            code="origin_not_allowed",
        )
    if policy.keys_required:
        if not key_accepted(policy, request_keys(request)):
            response = error_response(
                401,
                "Missing or wrong API key: send it as 'Authorization: Bearer KEY' or 'x-api-key: KEY' (Gemini "
                "clients: 'x-goog-api-key: KEY' or '?key=KEY').",
                code="invalid_api_key",
            )
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        if not policy.forward_api_key:
            request[_HIDDEN] = KEY_HEADERS
    return _endpoint_refusal(request, policy, decided)


def _endpoint_refusal(request: web.Request, policy: AccessPolicy, decided: RoutedPath) -> web.Response | None:
    path = decided.upstream_path
    reason = control_refusal(policy, request.method, path, request.query)
    if reason is not None:
        return error_response(
            403,
            f"{request.method} {path[:200]} is refused: {reason} (start the proxy with "
            "--allow-profile-control to pass them through)",
            code="control_endpoint",
        )
    state_changing = request.method not in _SAFE_METHODS and path.startswith("/adaptive/")
    if state_changing and "Content-Type" in request.headers and request.content_type in SIMPLE_FORM_TYPES:
        return error_response(
            415,
            f"{request.method} {path} takes no form data ({request.content_type}): an HTML "
            "form on any web page could send that",
            code="unsupported_media_type",
        )
    return None


def _preflight(policy: AccessPolicy, origin: str, wanted_headers: str | None) -> web.Response:
    if not cors_allowed(policy, origin):
        return error_response(
            403,
            f"cross-origin requests from {origin[:100]!r} are not allowed (--cors-origin)",
            code="origin_not_allowed",
        )
    allowed = wanted_headers or "authorization, content-type, x-api-key, x-goog-api-key, x-adaptive-spec-profile"
    return web.Response(
        status=204,
        headers={
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Allow-Headers": allowed,
            "Access-Control-Max-Age": _CORS_MAX_AGE_S,
        },
    )


def _shaped(api: Api, response: web.StreamResponse) -> web.StreamResponse:
    """/v1/messages clients parse Anthropic's error shape, Gemini's Google's; the proxy's own errors are
    OpenAI-shaped until here."""
    shape = traits(api)
    if (shape.anthropic or shape.google) and isinstance(response, web.Response) and response.status >= 400:
        body = response.body
        convert = as_anthropic if shape.anthropic else as_google
        converted = convert(response.status, body) if isinstance(body, bytes) else None
        if converted is not None:
            response.body = converted
    return response


async def _cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """llama-server reflects any Origin in its CORS headers: never pass those on; add ours for allowed origins."""
    if _PREFLIGHT not in request:
        for name in {k for k in response.headers if k.lower().startswith("access-control-")}:
            response.headers.popall(name, None)
    origin = request.headers.get("Origin")
    if origin is not None and cors_allowed(request.app[ACCESS], origin):
        response.headers["Access-Control-Allow-Origin"] = origin
        response.headers["Access-Control-Expose-Headers"] = _EXPOSED
        response.headers.add("Vary", "Origin")


class _MalformedHttpFilter(logging.Filter):
    """aiohttp logs every request it cannot parse with a full traceback; anyone could flood the log so. One line
    per interval instead, counting the rest; other errors (the proxy's own faults) keep their traceback."""

    def __init__(self) -> None:
        super().__init__()
        self.last_logged = -_BAD_HTTP_LOG_INTERVAL_S
        self.suppressed = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, http_exceptions.HttpProcessingError):
            return True
        now = time.monotonic()
        if now - self.last_logged < _BAD_HTTP_LOG_INTERVAL_S:
            self.suppressed += 1
            return False
        more = f" (and {self.suppressed} more since the last such line)" if self.suppressed else ""
        reason = " ".join(str(exc.message).split())[:200]  # aiohttp's message spans lines (a caret under the byte)
        record.msg, record.args = "refused a malformed HTTP request: %s%s", (reason, more)
        record.exc_info, record.exc_text = None, None
        self.last_logged, self.suppressed = now, 0
        return True


def quiet_malformed_http_logs() -> None:
    server_log = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, _MalformedHttpFilter) for f in server_log.filters):
        server_log.addFilter(_MalformedHttpFilter())
