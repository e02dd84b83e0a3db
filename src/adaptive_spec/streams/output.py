"""The generated output of a response — text and tool-call ids — read from any API's stream events or body.

The session tracker needs it twice: to recognise a served reply when a client sends it back (the reply echo), and to
replay it through the counterfactual n-gram drafter. A tool call is written as the model wrote it under the chat
templates of the Qwen family (and the ones shipped here): `{"name": "read", "arguments": {...}}` (`call_text`), so
the replay sees the tokens the model generated, and a call sent back in a later request reads the same.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

MAX_OUTPUT_CHARS = 4 * 1024 * 1024  # beyond this a reply is not kept (its stats are estimated from the prefix)
MAX_LIVE_CHARS = 64 * 1024  # live text not yet published (a feed reader keeps only the last few KB)


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


class CallHead(str):
    """The text that opens a tool call, up to its arguments: `{"name": "read", "arguments": `. Its own type, so
    that the collector knows where a call starts (and closes the one before)."""

    __slots__ = ()


class CallArguments(str):
    """A tool call's arguments, or a piece of them: text inside the call that `CallHead` opened."""

    __slots__ = ()


def call_head(name: Any) -> CallHead:
    name = _str(name)
    head = _HEADS.get(name)
    if head is None:
        head = CallHead('{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": ')
        if len(_HEADS) < _MAX_HEADS:
            _HEADS[name] = head
    return head


# The heads of the tools' names seen (a request carries back every call of its history: the same few names).
_HEADS: dict[str, CallHead] = {}
_MAX_HEADS = 4096


def call_text(name: Any, arguments: str, *, spaced: bool = True) -> str:
    """A whole tool call, its arguments as a chat template's `tojson` writes them (", " and ": ", keys in their
    order): llama-server renders a call sent back that way, whatever spacing the client gave it. `spaced=False`:
    the arguments as given (~30x cheaper: for what ignores whitespace, on the request path)."""
    if not spaced:
        return call_head(name) + arguments + "}"
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        written = arguments
    else:
        written = json.dumps(value, ensure_ascii=False)
    return call_head(name) + written + "}"


def _spaced(arguments: str) -> str:
    """A call's arguments as a template writes them (`call_text`), or as given when they are not JSON."""
    try:
        return json.dumps(orjson.loads(arguments), ensure_ascii=False)
    except (orjson.JSONDecodeError, TypeError, ValueError):
        return arguments


def _same_start(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


def _chat_message(message: dict[str, Any], texts: list[str], ids: list[str]) -> None:
    texts += [_str(message.get("reasoning_content")), _str(message.get("content"))]
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            if isinstance(call, dict):
                ids.append(_str(call.get("id")))
                function = call.get("function")
                if isinstance(function, dict):
                    if isinstance(function.get("name"), str):  # a stream gives it once, in the call's first delta
                        texts.append(call_head(function["name"]))
                    texts.append(CallArguments(_str(function.get("arguments"))))


def _response_item(item: dict[str, Any], texts: list[str], ids: list[str]) -> None:
    """A Responses-API output item (message, function_call, reasoning) or an Anthropic content block."""
    kind = item.get("type")
    if kind in ("function_call", "custom_tool_call"):
        ids.append(_str(item.get("call_id")))
        texts += [call_head(item.get("name")), CallArguments(_str(item.get("arguments")) or _str(item.get("input")))]
    elif kind == "tool_use":
        ids.append(_str(item.get("id")))
        texts.append(call_head(item.get("name")))
        texts.append(CallArguments(orjson.dumps(item.get("input")).decode() if item.get("input") is not None else ""))
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
            texts.append(CallArguments(delta) if kind == "response.function_call_arguments.delta" else delta)
        elif kind == "content_block_delta" and isinstance(delta, dict):  # Anthropic
            texts += [
                _str(delta.get("text")),
                CallArguments(_str(delta.get("partial_json"))),
                _str(delta.get("thinking")),
            ]
        elif kind == "content_block_start" and isinstance(obj.get("content_block"), dict):
            block = obj["content_block"]
            if block.get("type") == "tool_use":
                ids.append(_str(block.get("id")))
                texts.append(call_head(block.get("name")))
        elif (
            kind == "response.output_item.added"
            and isinstance(item := obj.get("item"), dict)
            and item.get("type") == "function_call"
        ):
            ids.append(_str(item.get("call_id")))
            texts.append(call_head(item.get("name")))
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
    """Joins a response's generated text and tool-call ids, up to MAX_OUTPUT_CHARS. Each tool call reads as
    `call_text` writes it, on a line of its own after any text before it (as a message sent back reads): a call is
    closed where text other than its arguments comes, or at the end."""

    __slots__ = ("_in_call", "_parts", "_size", "calls", "tool_call_ids", "truncated")

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._size = 0
        self._in_call = False
        self.calls = 0
        self.tool_call_ids: list[str] = []
        self.truncated = False

    def add(self, texts: list[str], ids: list[str]) -> None:
        for text in texts:
            if text:
                if self._size + len(text) > MAX_OUTPUT_CHARS:
                    self.truncated = True
                    return
                kind = type(text)
                if kind is CallHead or (self._in_call and kind is not CallArguments):
                    if self._in_call:
                        self._parts.append("}")
                    if kind is CallHead:
                        self.calls += 1
                        if self._parts:
                            self._parts.append("\n")
                    self._in_call = kind is CallHead
                self._parts.append(text)
                self._size += len(text)
        self.tool_call_ids += [i for i in ids if i]

    @property
    def text(self) -> str:
        return "".join(self._parts) + ("}" if self._in_call else "")

    def kept_share(self) -> float:
        """The share of `text` that the same reply, sent back in the next request, renders as it was generated:
        llama-server renders a call's arguments as `call_text` spaces them, so a model that wrote them otherwise
        (on several lines, say) finds its slot's copy of the reply reused only up to the first character that
        differs (its text before the call, the call's name). 1.0: all of it."""
        if not self.calls:
            return 1.0
        total = len(self.text)
        kept, i, parts = 0, 0, self._parts
        while i < len(parts):
            part = parts[i]
            if type(part) is not CallHead:
                kept += len(part)
                i += 1
                continue
            j = i + 1
            while j < len(parts) and type(parts[j]) is CallArguments:
                j += 1
            raw = "".join(parts[i + 1 : j])
            if raw[1:2].isspace():
                return kept / total  # arguments on lines of their own: the model wrote the whole call so
            kept += len(part)
            same = _same_start(raw, _spaced(raw))
            kept += same
            if same < len(raw):
                return kept / total
            i = j
        return 1.0
