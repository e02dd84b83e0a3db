"""Reading llama-server's `timings` (and usage) out of responses, streamed or not, for every API it speaks."""

from __future__ import annotations

from typing import Any

import orjson

from adaptive_spec.core.records import Timings
from adaptive_spec.core.sse import SSEEvent

# Where each API puts the object that may carry `timings` / `usage`: the event itself, or a nested object.
_CONTAINERS = ("response", "message")
# Responses-API and Anthropic stream events whose `delta` is generated text.
_DELTA_EVENT_TYPES = frozenset(
    {
        "response.output_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
        "response.function_call_arguments.delta",
        "content_block_delta",
    }
)


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def _float(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def parse_timings(raw: Any) -> Timings | None:
    """A llama-server `timings` object as a Timings; None when it is not an object."""
    if not isinstance(raw, dict):
        return None
    return Timings(
        prompt_n=_int(raw.get("prompt_n")),
        cache_n=_int(raw.get("cache_n")),
        predicted_n=_int(raw.get("predicted_n")),
        prompt_ms=_float(raw.get("prompt_ms")),
        predicted_ms=_float(raw.get("predicted_ms")),
        predicted_per_second=_float(raw.get("predicted_per_second")),
        draft_n=_int(raw.get("draft_n")),
        draft_n_accepted=_int(raw.get("draft_n_accepted")),
    )


def find_timings(obj: Any) -> Timings | None:
    """The `timings` of a response body or stream event, wherever the API nests it."""
    if not isinstance(obj, dict):
        return None
    found = parse_timings(obj.get("timings"))
    if found is not None:
        return found
    for key in _CONTAINERS:
        inner = obj.get(key)
        if isinstance(inner, dict):
            found = parse_timings(inner.get("timings"))
            if found is not None:
                return found
    return None


def _nonempty(value: Any) -> bool:
    return bool(value) and value is not None


def generated_pieces(obj: Any) -> int:
    """How many pieces of generated output a stream event carries (0 for role, usage or bookkeeping events)."""
    if not isinstance(obj, dict):
        return 0
    choices = obj.get("choices")
    if isinstance(choices, list):
        count = 0
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                if any(_nonempty(delta.get(k)) for k in ("content", "reasoning_content", "tool_calls")):
                    count += 1
            elif _nonempty(choice.get("text")):
                count += 1
        return count
    kind = obj.get("type")
    if isinstance(kind, str):
        if kind in _DELTA_EVENT_TYPES:
            delta = obj.get("delta")
            if isinstance(delta, dict):
                return int(any(_nonempty(v) for k, v in delta.items() if k != "type"))
            return int(_nonempty(delta))
        return 0
    # llama-server's native /completion stream: {"content": "...", "stop": false}
    return int(_nonempty(obj.get("content")) and "stop" in obj)


class ResponseMeter:
    """Accumulates what one response tells about itself: token arrival times, timings, an upstream error.

    The caller passes a monotonic clock reading in milliseconds with each piece, so this stays free of I/O.
    """

    __slots__ = ("_pieces", "error", "first_token_ms", "second_token_ms", "timings")

    def __init__(self) -> None:
        self.timings: Timings | None = None
        self.first_token_ms: float | None = None
        self.second_token_ms: float | None = None
        self.error: str | None = None
        self._pieces = 0

    def on_event(self, event: SSEEvent, now_ms: float) -> None:
        data = event.data
        if not data or data == "[DONE]":
            return
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        if not isinstance(obj, dict):
            return
        pieces = generated_pieces(obj)
        if pieces:
            if self._pieces == 0:
                self.first_token_ms = now_ms
            if self._pieces <= 1 and self._pieces + pieces >= 2:
                self.second_token_ms = now_ms
            self._pieces += pieces
        found = find_timings(obj)
        if found is not None:
            self.timings = found
        if event.event == "error" or "error" in obj:
            self.error = _error_text(obj)

    def on_body(self, body: bytes) -> None:
        """A whole non-streamed response body."""
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            return
        self.timings = find_timings(obj)
        if isinstance(obj, dict) and "error" in obj:
            self.error = _error_text(obj)


def _error_text(obj: dict[str, Any]) -> str:
    err = obj.get("error", obj)
    if isinstance(err, dict):
        message = err.get("message")
        if isinstance(message, str):
            return message
    return str(err)[:500]
