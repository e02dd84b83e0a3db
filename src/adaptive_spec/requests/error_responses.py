"""Error bodies in the shapes clients parse: OpenAI's `{"error": {...}}`, Anthropic's for /v1/messages, and Google's
for the Gemini API."""

from __future__ import annotations

import re
from typing import Any

import orjson
from aiohttp import web

from adaptive_spec.requests.apis import Api, traits
from adaptive_spec.requests.forwarding.outcome import Outcome
from adaptive_spec.requests.gemini.reply import SSE_END, google_error, stream_error


def error_body(message: str, *, type_: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    status: int, message: str, *, code: str, type_: str | None = None, param: str | None = None
) -> web.Response:
    if type_ is None:
        type_ = "invalid_request_error" if status < 500 else "upstream_error"
    body = orjson.dumps(error_body(message, type_=type_, code=code, param=param))
    return web.Response(status=status, body=body, content_type="application/json")


# Retry-After on the proxy's own 503s (a profile down, restarting, unreachable or hung; the shutdown): a crashed
# launched server is restarted after 1 s and answers again ~4-5 s after the crash on the 0.5B; one that was hung is
# taken back within a second of answering (the replica watch). SDKs that honour it (openai, anthropic) wait that long.
RETRY_AFTER_S = 5


def answer(outcome: Outcome) -> web.Response:
    """The answer to a request the proxy refused or could not forward, in OpenAI's shape; a 503 says when to try
    again."""
    resp = error_response(outcome.status, outcome.error or "", code=outcome.code or "error", param=outcome.param)
    if outcome.status == 503:
        resp.headers["Retry-After"] = str(RETRY_AFTER_S)
    return resp


def sse_error_event(api: Api, message: str, *, code: str) -> bytes:
    """The last event of a stream whose upstream failed after the headers were sent."""
    if api is Api.MESSAGES:
        payload = {"type": "error", "error": {"type": "api_error", "message": message}}
        return b"event: error\ndata: " + orjson.dumps(payload) + b"\n\n"
    if traits(api).google:  # Gemini's Server-Sent Events (alt=sse): its error as a chunk of its own
        return b"data: " + orjson.dumps(stream_error(message, code)) + SSE_END
    body = error_body(message, type_="upstream_error", code=code)
    if api is Api.RESPONSES:
        return b"event: error\ndata: " + orjson.dumps({"type": "error", **body}) + b"\n\n"
    return b"data: " + orjson.dumps(body) + b"\n\n"


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    default = "invalid_request_error" if status < 500 else "api_error"
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, default), "message": message}}


def as_anthropic(status: int, body: bytes) -> bytes | None:
    """An OpenAI-shaped error body in Anthropic's shape, for /v1/messages clients; None if it is not one."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    error = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(error, dict) or obj.get("type") == "error" or not isinstance(error.get("message"), str):
        return None
    return orjson.dumps(anthropic_error_body(status, error["message"]))


def as_google(status: int, body: bytes) -> bytes | None:
    """An OpenAI-shaped error body in Google's shape, for Gemini clients; None if it is not one."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    error = obj.get("error") if isinstance(obj, dict) else None
    if not isinstance(error, dict) or "status" in error or not isinstance(error.get("message"), str):
        return None
    return orjson.dumps(google_error(status, error["message"]))


# How llama-server words the request problems it reports as 500 (a body it could not parse or cannot serve).
_CLIENT_FAULT = re.compile(
    r"^(Failed to parse|\[json\.exception\.|Invalid|Unsupported|Missing|Expected|Cannot use both|"
    r"[^.]{0,80} (is not supported|must be|requires))"
)


def as_client_error(status: int, body: bytes) -> tuple[int, bytes]:
    """A profile's 500 for a request it could not parse is the client's mistake: 400, in the same shape."""
    if status != 500:
        return status, body
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return status, body
    error = obj.get("error") if isinstance(obj, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if not isinstance(message, str) or not _CLIENT_FAULT.match(message):
        return status, body
    return 400, orjson.dumps(error_body(message, type_="invalid_request_error", code="invalid_request"))
