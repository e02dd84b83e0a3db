"""llama-server's chat completion, a body or its stream, as Gemini's answer: `candidates[0].content.parts` (text,
thoughts, function calls), a `finishReason`, `usageMetadata` from llama-server's timings, `modelVersion` the model the
client asked for; errors in Google's shape (`{"error": {"code", "message", "status"}}`).

A stream's last chunk always carries the `finishReason` and the usage, and the stream's last piece of text with them
(Gemini CLI retries a stream whose chunks end without a finish reason, and skips a chunk whose text part is empty):
each piece of text goes out when the next one arrives. Function calls go out whole in the last chunk. Pure."""

from __future__ import annotations

from typing import Any

import orjson

from adaptive_spec.streams.sse import SSEParser

_FINISH = {
    "stop": "STOP",
    "tool_calls": "STOP",  # Gemini has no finish reason of its own for calls: STOP with functionCall parts
    "function_call": "STOP",
    "length": "MAX_TOKENS",
    "content_filter": "SAFETY",
}
# Google's canonical status names by HTTP status (google.rpc.Code as the REST API reports it).
_STATUS = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    405: "INVALID_ARGUMENT",
    409: "ABORTED",
    413: "INVALID_ARGUMENT",
    415: "INVALID_ARGUMENT",
    429: "RESOURCE_EXHAUSTED",
    499: "CANCELLED",
    501: "UNIMPLEMENTED",
    503: "UNAVAILABLE",
    504: "DEADLINE_EXCEEDED",
}
# The proxy's error codes of a stream that failed after its headers, as the HTTP status they stand for.
_CODE_STATUS = {
    "upstream_timeout": 504,
    "upstream_unreachable": 503,
    "upstream_unresponsive": 503,
    "profile_unavailable": 503,
    "proxy_shutting_down": 503,
}
SSE_END = b"\r\n\r\n"


def finish_reason(reason: Any) -> str:
    """A chat completion's finish reason in Gemini's words (none given: the answer ended, STOP)."""
    if reason is None:
        return "STOP"
    return _FINISH.get(reason, "OTHER") if isinstance(reason, str) else "OTHER"


def google_error(status: int, message: str) -> dict[str, Any]:
    """An error body in Google's shape."""
    name = _STATUS.get(status) or ("INTERNAL" if status >= 500 else "INVALID_ARGUMENT")
    return {"error": {"code": status, "message": message, "status": name}}


def stream_error(message: str, code: str) -> dict[str, Any]:
    """The error that ends a stream which failed after its headers went out, from the proxy's error code."""
    return google_error(_CODE_STATUS.get(code, 500), message)


def usage_metadata(timings: Any, usage: Any) -> dict[str, int] | None:
    """Gemini's counts: `promptTokenCount` the whole prompt, cached tokens included (llama-server's `prompt_n` +
    `cache_n`), `cachedContentTokenCount` those cached; from `usage` when there are no timings."""
    if isinstance(timings, dict) and isinstance(timings.get("prompt_n"), int):
        cached = _count(timings.get("cache_n"))
        prompt, output = _count(timings.get("prompt_n")) + cached, _count(timings.get("predicted_n"))
    elif isinstance(usage, dict):
        details = usage.get("prompt_tokens_details")
        cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else 0
        prompt, output = _count(usage.get("prompt_tokens")), _count(usage.get("completion_tokens"))
    else:
        return None
    out = {"promptTokenCount": prompt, "candidatesTokenCount": output, "totalTokenCount": prompt + output}
    if cached:
        out["cachedContentTokenCount"] = cached
    return out


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _function_call(call_id: Any, name: Any, arguments: Any) -> dict[str, Any] | None:
    """A chat tool call as a functionCall part; None when its arguments are not a JSON object."""
    try:
        args = orjson.loads(arguments) if isinstance(arguments, str) and arguments.strip() else {}
    except orjson.JSONDecodeError:
        return None
    if not isinstance(args, dict) or not isinstance(name, str):
        return None
    call: dict[str, Any] = {"name": name, "args": args}
    if isinstance(call_id, str) and call_id:
        call["id"] = call_id  # sent back by the client with the call and its response: the ids stay stable
    return {"functionCall": call}


def _response(parts: list[dict[str, Any]], finish: str | None, chat: dict[str, Any], model: str) -> dict[str, Any]:
    content: dict[str, Any] = {"role": "model", "parts": parts} if parts else {"role": "model"}
    candidate: dict[str, Any] = {"content": content, "index": 0}
    if finish is not None:
        candidate["finishReason"] = finish
    out: dict[str, Any] = {"candidates": [candidate]}
    usage = usage_metadata(chat.get("timings"), chat.get("usage")) if finish is not None else None
    if usage is not None:
        out["usageMetadata"] = usage
    out["modelVersion"] = model
    if isinstance(chat.get("id"), str):
        out["responseId"] = chat["id"]
    return out


def gemini_body(chat: Any, model: str) -> dict[str, Any]:
    """A whole chat completion body as a GenerateContentResponse (an error body as Google's error)."""
    if not isinstance(chat, dict):
        return google_error(502, "llama-server answered something that is not a chat completion")
    if "error" in chat:
        return _error_of(chat["error"])
    choice = _first_choice(chat)
    found = choice.get("message")
    message: dict[str, Any] = found if isinstance(found, dict) else {}
    parts: list[dict[str, Any]] = []
    if isinstance(message.get("reasoning_content"), str) and message["reasoning_content"]:
        parts.append({"text": message["reasoning_content"], "thought": True})
    if isinstance(message.get("content"), str) and message["content"]:
        parts.append({"text": message["content"]})
    finish = finish_reason(choice.get("finish_reason"))
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        part = None
        if isinstance(call, dict) and isinstance(function, dict):
            part = _function_call(call.get("id"), function.get("name"), function.get("arguments"))
        if part is None:
            finish = "MALFORMED_FUNCTION_CALL"
            continue
        parts.append(part)
    return _response(parts, finish, chat, model)


def _error_of(error: Any) -> dict[str, Any]:
    """llama-server's error object (its message, its HTTP status as `code`) in Google's shape."""
    text = error.get("message") if isinstance(error, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return google_error(code if isinstance(code, int) and 400 <= code < 600 else 500, str(text or error))


def _first_choice(chat: dict[str, Any]) -> dict[str, Any]:
    choices = chat.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    return first if isinstance(first, dict) else {}


def gemini_body_bytes(status: int, data: bytes, model: str) -> bytes:
    """A whole chat completion answer's bytes as Gemini's (an error in Google's shape, with its status)."""
    try:
        chat = orjson.loads(data)
    except orjson.JSONDecodeError:
        text = data[:1000].decode(errors="replace")
        return orjson.dumps(google_error(status if status >= 400 else 502, text or "an empty answer"))
    if status >= 400 and not (isinstance(chat, dict) and "error" in chat):
        return orjson.dumps(google_error(status, data[:1000].decode(errors="replace")))
    return orjson.dumps(gemini_body(chat, model))


class GeminiAnswer:
    """llama-server's answer to one translated request as Gemini's: a whole body (`body`), or a stream fed as it
    arrives (`feed`, then `close` or `error`) going out as Server-Sent Events (`alt=sse`) or as one JSON array whose
    elements go out as they are made."""

    def __init__(self, model: str, *, stream: bool = False, sse: bool = False) -> None:
        self._model, self.stream, self._sse = model, stream, sse and stream
        self._parser = SSEParser()
        self._held: list[dict[str, Any]] = []  # the last piece of text, sent with the next piece or the last chunk
        self._calls: dict[int, list[Any]] = {}  # index -> [id, name, arguments so far]
        self._last: dict[str, Any] = {}  # the chat chunk fields the last Gemini chunk is made of
        self._finish: Any = None
        self._written = 0  # array elements written
        self.ended = False  # the last chunk (or an error) went out

    @property
    def content_type(self) -> str:
        return "text/event-stream" if self._sse else "application/json"

    def body(self, status: int, data: bytes) -> bytes:
        """A whole answer's bytes as Gemini's (an error in Google's shape)."""
        return gemini_body_bytes(status, data, self._model)

    def feed(self, data: bytes) -> bytes:
        """The bytes to send for this much of llama-server's stream (b"" while nothing is complete)."""
        out: list[dict[str, Any]] = []
        for event in self._parser.feed(data):
            if self.ended:
                break
            if event.data == "[DONE]":
                out.append(self._final())
                continue
            try:
                obj = orjson.loads(event.data) if event.data else None
            except orjson.JSONDecodeError:
                continue
            if isinstance(obj, dict):
                out.extend(self._chunk(obj))
        return b"".join(self._frame(chunk) for chunk in out)

    def close(self) -> bytes:
        """The bytes that end the stream after llama-server's ended: the last chunk if it has not gone out yet, and
        the array's closing bracket."""
        last = b"" if self.ended else self._frame(self._final())
        return last + self._close_array()

    def error(self, message: str, code: str) -> bytes:
        """The bytes that end the stream with an error (the proxy's `code` says which status it stands for), after
        the text held back so far."""
        held = [] if self.ended else self._flush()
        self.ended = True
        return b"".join(map(self._frame, [*held, stream_error(message, code)])) + self._close_array()

    def _flush(self) -> list[dict[str, Any]]:
        held, self._held = self._held, []
        return [self._response(held)] if held else []

    def _close_array(self) -> bytes:
        if self._sse:
            return b""
        return b"]" if self._written else b"[]"

    def _frame(self, chunk: dict[str, Any]) -> bytes:
        data = orjson.dumps(chunk)
        if self._sse:
            return b"data: " + data + SSE_END
        self._written += 1
        return (b"[" if self._written == 1 else b",\r\n") + data

    def _chunk(self, obj: dict[str, Any]) -> list[dict[str, Any]]:
        """One chat chunk read: the Gemini chunks it lets go out now."""
        if "error" in obj:
            self.ended = True
            return [*self._flush(), gemini_body(obj, self._model)]
        for key in ("id", "timings", "usage"):
            if key in obj:
                self._last[key] = obj[key]
        choice = _first_choice(obj)
        if choice.get("finish_reason") is not None:
            self._finish = choice["finish_reason"]
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            return []
        out = []
        thought = delta.get("reasoning_content")
        if isinstance(thought, str) and thought:
            out.append(self._response([{"text": thought, "thought": True}]))
        text = delta.get("content")
        if isinstance(text, str) and text:
            out.extend(self._flush())
            self._held = [{"text": text}]
        for call in delta.get("tool_calls") or ():
            if isinstance(call, dict):
                self._add_call(call)
        return out

    def _add_call(self, call: dict[str, Any]) -> None:
        """One tool call's delta: its id and name once, its arguments piece by piece."""
        index = call.get("index")
        held = self._calls.setdefault(index if isinstance(index, int) else len(self._calls), [None, "", ""])
        function = call.get("function")
        if isinstance(call.get("id"), str) and call["id"]:
            held[0] = call["id"]
        if isinstance(function, dict):
            held[1] += function.get("name") or ""
            held[2] += function.get("arguments") or ""

    def _response(self, parts: list[dict[str, Any]], finish: str | None = None) -> dict[str, Any]:
        return _response(parts, finish, self._last, self._model)

    def _final(self) -> dict[str, Any]:
        self.ended = True
        finish = finish_reason(self._finish)
        parts = list(self._held)
        for call_id, name, arguments in self._calls.values():
            part = _function_call(call_id, name, arguments)
            if part is None:
                finish = "MALFORMED_FUNCTION_CALL"
                continue
            parts.append(part)
        return self._response(parts, finish)
