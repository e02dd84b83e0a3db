"""What the proxy needs to know about a client request: which API, which project, and whether it is well formed."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import orjson

from adaptive_spec.requests.apis import Api
from adaptive_spec.requests.body.shapes import RequestProblem, check_shape
from adaptive_spec.requests.gemini.request import gemini_api

_PROJECT_PREFIX = re.compile(r"^/p/([A-Za-z0-9][A-Za-z0-9._-]{0,127})(/.*)?$")

# Path (after any /p/<project> prefix) → API name. llama-server serves each with and without the /v1 prefix.
_APIS = {
    "/v1/chat/completions": Api.CHAT,
    "/chat/completions": Api.CHAT,
    "/v1/completions": Api.COMPLETIONS,
    "/completions": Api.COMPLETIONS,
    "/v1/responses": Api.RESPONSES,
    "/responses": Api.RESPONSES,
    "/v1/messages": Api.MESSAGES,
    "/v1/messages/count_tokens": Api.COUNT_TOKENS,
    "/v1/models": Api.MODELS,
    "/models": Api.MODELS,
    "/completion": Api.COMPLETION,
}

# The request field each API cannot do without, and the JSON types it may take.
_REQUIRED: dict[Api, tuple[str, tuple[type, ...]]] = {
    Api.CHAT: ("messages", (list,)),
    Api.COMPLETIONS: ("prompt", (str, list)),
    Api.RESPONSES: ("input", (str, list)),
    Api.MESSAGES: ("messages", (list,)),
    Api.COMPLETION: ("prompt", (str, list)),
}
_OPTIONAL_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "model": ((str,), "a string"),
    "stream": ((bool,), "a boolean"),
    "max_tokens": ((int,), "an integer"),
    "max_completion_tokens": ((int,), "an integer"),
    "max_output_tokens": ((int,), "an integer"),
    "n_predict": ((int,), "an integer"),
    "n": ((int,), "an integer"),
    "temperature": ((int, float), "a number"),
    "top_p": ((int, float), "a number"),
    "stream_options": ((dict,), "an object"),
}
_TYPE_NAMES: dict[type, str] = {list: "an array", str: "a string", dict: "an object"}


@dataclass(frozen=True, slots=True)
class RoutedPath:
    """A request path split into its project (from a `/p/<project>` prefix, else None) and the upstream path."""

    project: str | None
    upstream_path: str
    api: Api


def split_path(path: str) -> RoutedPath:
    project: str | None = None
    match = _PROJECT_PREFIX.match(path)
    if match:
        project = match.group(1)
        path = match.group(2) or "/"
    api = _APIS.get(path.rstrip("/") or "/") or gemini_api(path) or Api.OTHER
    return RoutedPath(project, path, api)


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    body: dict[str, Any]
    stream: bool
    model: str | None


def parse_body(api: Api, raw: bytes) -> ParsedRequest | RequestProblem:
    """Parse a JSON request body once and check the fields the proxy and llama-server rely on."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return RequestProblem(f"The request body is not valid JSON: {exc}", "invalid_json")
    if not isinstance(obj, dict):
        return RequestProblem(f"The request body must be a JSON object, not {_json_type(obj)}.", "invalid_type")
    required = _REQUIRED.get(api)
    if required is not None:
        field, types = required
        if field not in obj:
            return RequestProblem(f"'{field}' is a required property.", "missing_required_parameter", field)
        if not isinstance(obj[field], types):
            wanted = " or ".join(_TYPE_NAMES[t] for t in types)
            return _wrong_type(field, wanted, obj[field])
    for field, (types, wanted) in _OPTIONAL_TYPES.items():
        value = obj.get(field)
        if value is None:
            continue
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            return _wrong_type(field, wanted, value)
    problem = check_shape(api, obj)
    if problem is not None:
        return problem
    model = obj.get("model")
    return ParsedRequest(obj, bool(obj.get("stream", False)), model if isinstance(model, str) else None)


_EMPTY_REST = re.compile(rb"[ \t\r\n]*\}")


def with_fields(raw: bytes, fields: dict[str, Any]) -> bytes:
    """A JSON object's bytes with `fields` it does not have added at its start, the client's bytes otherwise as they
    came (no re-serialising of a long history). `raw` must parse as a JSON object without those keys."""
    start = raw.index(b"{") + 1
    added = b",".join(orjson.dumps(key) + b":" + orjson.dumps(value) for key, value in fields.items())
    empty = _EMPTY_REST.match(raw, start) is not None
    # The rest copied once, by the join (a long history's 500 KB, not twice).
    return b"".join((raw[:start], added, b"" if empty else b",", memoryview(raw)[start:]))


def _wrong_type(field: str, wanted: str, value: Any) -> RequestProblem:
    return RequestProblem(
        f"Invalid type for '{field}': expected {wanted}, but got {_json_type(value)}.", "invalid_type", field
    )


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object"
