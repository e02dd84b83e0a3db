"""Reading llama-server's `timings` (and usage) out of responses, streamed or not, for every API it speaks."""

from __future__ import annotations

from typing import Any

import orjson

from adaptive_spec.streams.sse import SSEEvent
from adaptive_spec.telemetry.records import Timings

# Where each API puts the object that may carry `timings` / `usage`: the event itself, or a nested object.
_CONTAINERS = ("response", "message")
# The last event of a Responses-API or Anthropic stream (OpenAI chat/completions end with `data: [DONE]`).
END_EVENTS = frozenset({"response.completed", "response.failed", "response.incomplete", "message_stop"})
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


def as_int(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def _float(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def parse_timings(raw: Any) -> Timings | None:
    """A llama-server `timings` object as a Timings; None when it is not an object."""
    if not isinstance(raw, dict):
        return None
    drafter_n, drafter_n_accepted = _drafter_counts(raw.get("draft_by_type"))
    return Timings(
        prompt_n=as_int(raw.get("prompt_n")),
        cache_n=as_int(raw.get("cache_n")),
        predicted_n=as_int(raw.get("predicted_n")),
        prompt_ms=_float(raw.get("prompt_ms")),
        predicted_ms=_float(raw.get("predicted_ms")),
        predicted_per_second=_float(raw.get("predicted_per_second")),
        draft_n=as_int(raw.get("draft_n")),
        draft_n_accepted=as_int(raw.get("draft_n_accepted")),
        drafter_n=drafter_n,
        drafter_n_accepted=drafter_n_accepted,
    )


def _drafter_counts(by_type: Any) -> tuple[int, int]:
    """The model drafter's drafted and accepted tokens in a patched server's `draft_by_type` (every type that does
    not draft from n-grams: draft-dflash, draft-simple, draft-mtp, ...); 0, 0 when it is absent."""
    if not isinstance(by_type, dict):
        return 0, 0
    drafted = accepted = 0
    for name, counts in by_type.items():
        if isinstance(counts, dict) and isinstance(name, str) and not name.startswith("ngram"):
            drafted += as_int(counts.get("draft_n"))
            accepted += as_int(counts.get("draft_n_accepted"))
    return drafted, accepted


def find_timings(obj: Any) -> Timings | None:
    """The `timings` of a response body or stream event, wherever the API nests it."""
    return parse_timings(raw_timings(obj))


def raw_timings(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict):
        return None
    found = obj.get("timings")
    if isinstance(found, dict):
        return found
    for key in _CONTAINERS:
        inner = obj.get(key)
        if isinstance(inner, dict) and isinstance(inner.get("timings"), dict):
            return inner["timings"]  # type: ignore[no-any-return]
    return None


def find_usage(obj: Any) -> dict[str, Any] | None:
    """The `usage` object of a response or stream event (OpenAI, Responses or Anthropic shape)."""
    if not isinstance(obj, dict):
        return None
    for holder in (obj, obj.get("response"), obj.get("message")):
        if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
            usage: dict[str, Any] = holder["usage"]
            return usage
    return None


def timings_from_usage(usage: dict[str, Any]) -> Timings:
    """Token counts from `usage` when a response carries no `timings` (llama-server's Anthropic API).

    Anthropic's `input_tokens` excludes cached ones; OpenAI's `prompt_tokens` includes them. Draft counts are
    not in usage, so they read 0.
    """
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    if "cache_read_input_tokens" in usage:
        cache_n = as_int(usage.get("cache_read_input_tokens"))
        prompt_n = as_int(usage.get("input_tokens"))
    else:
        cache_n = as_int(details.get("cached_tokens")) if isinstance(details, dict) else 0
        prompt_n = max(0, as_int(usage.get("prompt_tokens", usage.get("input_tokens"))) - cache_n)
    predicted_n = as_int(usage.get("completion_tokens", usage.get("output_tokens")))
    return Timings(prompt_n=prompt_n, cache_n=cache_n, predicted_n=predicted_n, from_usage=True)


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


_PLAIN_DELTA_KEYS = frozenset(("content", "role"))


def chat_delta_text(obj: dict[str, Any]) -> str | None:
    """The text of a chat stream chunk with one choice whose delta holds a string `content` (and maybe `role`) and
    nothing else; None for any other event. Most events of a chat stream are this shape: the relay reads them here
    instead of through `event_output` and `generated_pieces`, which walk every shape."""
    choices = obj.get("choices")
    if type(choices) is not list or len(choices) != 1:
        return None
    choice = choices[0]
    delta = choice.get("delta") if type(choice) is dict else None
    if type(delta) is not dict:
        return None
    content = delta.get("content")
    if type(content) is not str or not _PLAIN_DELTA_KEYS.issuperset(delta):
        return None
    return content


def loads_or_none(data: str | bytes) -> Any:
    """The JSON value, or None when it is not JSON."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


def is_final_chunk(obj: dict[str, Any]) -> bool:
    kind = obj.get("type")
    if isinstance(kind, str):  # a Responses-API event: its last one carries the timings
        return kind in END_EVENTS
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices:
        return True  # the usage chunk of `stream_options.include_usage`
    return any(isinstance(c, dict) and c.get("finish_reason") for c in choices)


def without_progress_timings(events: list[SSEEvent], parsed: list[dict[str, Any] | None] | None = None) -> bytes:
    """Re-encode stream events for a client that did not ask for per-token timings: `timings` stays only on the
    final chunk, where llama-server puts it anyway. `parsed`, when given, holds each event's already parsed object."""
    out = bytearray()
    for i, event in enumerate(events):
        data = event.data
        if '"timings"' in data and data.startswith("{"):
            obj = parsed[i] if parsed is not None else loads_or_none(data)
            if isinstance(obj, dict) and "timings" in obj and not is_final_chunk(obj):
                del obj["timings"]
                data = orjson.dumps(obj).decode()
        if event.event:
            out += b"event: " + event.event.encode() + b"\n"
        for line in data.split("\n"):
            out += b"data: " + line.encode() + b"\n"
        out += b"\n"
    return bytes(out)
