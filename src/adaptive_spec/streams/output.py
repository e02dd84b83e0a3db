"""The generated output of a response — text and tool-call ids — read from any API's stream events or body.

The session tracker needs it twice: to recognise a served reply when a client sends it back (the reply echo), and to
replay it through the counterfactual n-gram drafter.
"""

from __future__ import annotations

from typing import Any

import orjson

MAX_OUTPUT_CHARS = 4 * 1024 * 1024  # beyond this a reply is not kept (its stats are estimated from the prefix)
MAX_LIVE_CHARS = 64 * 1024  # live text not yet published (a feed reader keeps only the last few KB)


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _chat_message(message: dict[str, Any], texts: list[str], ids: list[str]) -> None:
    texts += [_str(message.get("reasoning_content")), _str(message.get("content"))]
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            if isinstance(call, dict):
                ids.append(_str(call.get("id")))
                function = call.get("function")
                if isinstance(function, dict):
                    texts.append(_str(function.get("arguments")))


def _response_item(item: dict[str, Any], texts: list[str], ids: list[str]) -> None:
    """A Responses-API output item (message, function_call, reasoning) or an Anthropic content block."""
    kind = item.get("type")
    if kind in ("function_call", "custom_tool_call"):
        ids.append(_str(item.get("call_id")))
        texts.append(_str(item.get("arguments")) or _str(item.get("input")))
    elif kind == "tool_use":
        ids.append(_str(item.get("id")))
        texts.append(orjson.dumps(item.get("input")).decode() if item.get("input") is not None else "")
    elif kind in ("text", "output_text", "thinking"):
        texts.append(_str(item.get("text")) or _str(item.get("thinking")))
    content = item.get("content")
    if isinstance(content, list):
        for part in content:
            if isinstance(part, dict):
                _response_item(part, texts, ids)


def event_output(obj: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(text pieces, tool-call ids) carried by one stream event."""
    texts: list[str] = []
    ids: list[str] = []
    choices = obj.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                _chat_message(delta, texts, ids)
            else:
                texts.append(_str(choice.get("text")))
        return texts, ids
    kind = obj.get("type")
    if isinstance(kind, str):
        delta = obj.get("delta")
        if kind.endswith(".delta") and isinstance(delta, str):  # Responses API text / arguments deltas
            texts.append(delta)
        elif kind == "content_block_delta" and isinstance(delta, dict):  # Anthropic
            texts += [_str(delta.get(k)) for k in ("text", "partial_json", "thinking")]
        elif kind == "content_block_start" and isinstance(obj.get("content_block"), dict):
            block = obj["content_block"]
            if block.get("type") == "tool_use":
                ids.append(_str(block.get("id")))
        elif kind == "response.output_item.added" and isinstance(item := obj.get("item"), dict):
            ids.append(_str(item.get("call_id")) if item.get("type") == "function_call" else "")
        return texts, ids
    if "stop" in obj:  # llama-server's native /completion
        texts.append(_str(obj.get("content")))
    return texts, ids


def body_output(obj: Any) -> tuple[list[str], list[str]]:
    """(text pieces, tool-call ids) of a whole non-streamed response."""
    texts: list[str] = []
    ids: list[str] = []
    if not isinstance(obj, dict):
        return texts, ids
    choices = obj.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict):
                message = choice.get("message")
                if isinstance(message, dict):
                    _chat_message(message, texts, ids)
                else:
                    texts.append(_str(choice.get("text")))
    for key in ("output", "content"):  # Responses API items; Anthropic content blocks
        items = obj.get(key)
        if isinstance(items, list):
            for item in items:
                if isinstance(item, dict):
                    _response_item(item, texts, ids)
    if isinstance(obj.get("content"), str) and "stop" in obj:
        texts.append(obj["content"])
    return texts, ids


class LiveText:
    """A streamed answer's new text in pieces, each marked when it came from accepted drafts, for the live view.

    llama-server marks no token as drafted. With per-token timings, the chunk after which `draft_n_accepted` grew by
    k is taken to start a run of k accepted-draft tokens (one token a chunk); an inference, and labelled as one.
    """

    __slots__ = ("_accepted", "_credit", "_pending", "_size")

    def __init__(self) -> None:
        self._pending: list[tuple[str, bool]] = []
        self._accepted = 0
        self._credit = 0
        self._size = 0

    def add(self, text: str, accepted_total: int | None) -> None:
        if accepted_total is not None and accepted_total > self._accepted:
            self._credit += accepted_total - self._accepted
            self._accepted = accepted_total
        drafted = self._credit > 0
        if drafted:
            self._credit -= 1
        if not text or self._size > MAX_LIVE_CHARS:  # nobody takes them: keep a bound all the same
            return
        self._size += len(text)
        if self._pending and self._pending[-1][1] == drafted:
            self._pending[-1] = (self._pending[-1][0] + text, drafted)
        else:
            self._pending.append((text, drafted))

    def take(self) -> list[tuple[str, bool]]:
        """The pieces since the last call."""
        pieces, self._pending, self._size = self._pending, [], 0
        return pieces


class OutputCollector:
    """Joins a response's generated text and tool-call ids, up to MAX_OUTPUT_CHARS."""

    __slots__ = ("_parts", "_size", "tool_call_ids", "truncated")

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._size = 0
        self.tool_call_ids: list[str] = []
        self.truncated = False

    def add(self, texts: list[str], ids: list[str]) -> None:
        for text in texts:
            if text:
                if self._size + len(text) > MAX_OUTPUT_CHARS:
                    self.truncated = True
                    return
                self._parts.append(text)
                self._size += len(text)
        self.tool_call_ids += [i for i in ids if i]

    @property
    def text(self) -> str:
        return "".join(self._parts)
