"""Error bodies in the shapes clients parse: OpenAI's `{"error": {...}}`, and Anthropic's for /v1/messages."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web


def error_body(message: str, *, type_: str, code: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(
    status: int, message: str, *, code: str, type_: str | None = None, param: str | None = None
) -> web.Response:
    if type_ is None:
        type_ = "invalid_request_error" if status < 500 else "upstream_error"
    body = orjson.dumps(error_body(message, type_=type_, code=code, param=param))
    return web.Response(status=status, body=body, content_type="application/json")


def sse_error_event(api: str, message: str, *, code: str) -> bytes:
    """The last event of a stream whose upstream failed after the headers were sent."""
    if api == "messages":
        payload = {"type": "error", "error": {"type": "api_error", "message": message}}
        return b"event: error\ndata: " + orjson.dumps(payload) + b"\n\n"
    body = error_body(message, type_="upstream_error", code=code)
    if api == "responses":
        return b"event: error\ndata: " + orjson.dumps({"type": "error", **body}) + b"\n\n"
    return b"data: " + orjson.dumps(body) + b"\n\n"
