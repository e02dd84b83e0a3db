"""An agent stuck on one tool call: the history ends with the same call (its name and arguments) made again and again,
each answered by its result.

Small models do this (opencode made 78 identical `write` calls in one turn on the embedded 0.5B, Codex CLI 19 identical
failing calls) and no agent stops it. This module finds the loop in a request body and writes the body that breaks it: a
note after the last result and, from a second threshold, a request for a text answer (`tool_choice` none), which ends
the agent's turn. Pure: the request path decides when to apply it."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from adaptive_spec.requests.apis import Api, traits


@dataclass(frozen=True, slots=True)
class RepeatedCall:
    """The call the history ends with, and how many times in a row it was made (each with its result)."""

    name: str
    times: int


@dataclass(frozen=True, slots=True)
class Guarded:
    """The body to send instead of the client's (which the session's statistics keep seeing), and why."""

    body: dict[str, Any]
    repeat: RepeatedCall
    text_only: bool  # a text answer was asked for (tool_choice "none")

    def describe(self) -> str:
        asked = ", text answer asked" if self.text_only else ""
        return f"{self.repeat.name} ×{self.repeat.times} in a row, same arguments: note added{asked}"


def guard(api: Api, body: Mapping[str, Any], repeat: RepeatedCall, note_after: int, text_after: int) -> Guarded | None:
    """The body that breaks the loop `repeat` (from `trailing_repeat`), once the call was made `note_after` (a note)
    or `text_after` (a text answer) times in a row; 0 turns either off. None: not long enough yet."""
    text = 0 < text_after <= repeat.times
    if not (text or 0 < note_after <= repeat.times):
        return None
    out = guarded_body(api, body, repeat, text_only=text)
    return Guarded(out, repeat, text_asked(api, body, text))


def trailing_repeat(api: Api, body: Mapping[str, Any]) -> RepeatedCall | None:
    """The identical call the history ends on, made two or more times in a row; None otherwise (also when the last
    message is the user's own: a person spoke since, so the agent is not looping)."""
    if api is Api.CHAT:
        calls = _chat_calls(body.get("messages"))
    elif api is Api.RESPONSES:
        calls = _responses_calls(body.get("input"))
    elif api is Api.MESSAGES:
        calls = _messages_calls(body.get("messages"))
    else:
        return None
    # Newest first, read only until one differs: an agent's long run of different calls costs two reads, not all.
    last = next(calls, None)
    times = 1
    for call in calls:
        if call != last:
            break
        times += 1
    return RepeatedCall(_names(last), times) if last is not None and times >= 2 else None


def note(repeat: RepeatedCall) -> str:
    return (
        f"[adaptive-spec] The last {repeat.times} tool calls were the same call ({repeat.name}, with the same "
        "arguments), and its result is above. Calling it again will not change that result: do not repeat it. "
        "Answer the user, or make a different call."
    )


def guarded_body(api: Api, body: Mapping[str, Any], repeat: RepeatedCall, *, text_only: bool) -> dict[str, Any]:
    """The body with the note after the last tool result; `text_only` also asks for an answer without tool calls,
    where the API lets llama-server take that and the client did not require a call itself."""
    text = note(repeat)
    out = dict(body)
    if api is Api.CHAT:
        out["messages"] = [*body["messages"], {"role": "user", "content": text}]
    elif api is Api.RESPONSES:
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
        out["input"] = [*body["input"], item]
    elif api is Api.MESSAGES:
        messages = list(body["messages"])
        last = dict(messages[-1])
        content = last.get("content")
        blocks = list(content) if isinstance(content, list) else [{"type": "text", "text": str(content)}]
        last["content"] = [*blocks, {"type": "text", "text": text}]
        messages[-1] = last
        out["messages"] = messages
    if text_asked(api, body, text_only):
        out["tool_choice"] = {"type": "none"} if api is Api.MESSAGES else "none"
    return out


def text_asked(api: Api, body: Mapping[str, Any], text_only: bool) -> bool:
    """Whether `guarded_body(..., text_only=text_only)` asks for a text answer."""
    choice = body.get("tool_choice", "auto")
    if isinstance(choice, Mapping):  # Anthropic's {"type": "auto"}
        choice = choice.get("type")
    return text_only and traits(api).text_choice and choice == "auto"


# A call's identity: (name, arguments as canonical JSON). One assistant turn may make several calls: its calls
# together are one entry. Entries are listed newest first.
_Call = tuple[tuple[str, str], ...]


def _canonical(arguments: Any) -> str:
    if isinstance(arguments, str):
        text = arguments
        try:
            arguments = orjson.loads(text)
        except orjson.JSONDecodeError:
            return text
    try:
        return orjson.dumps(arguments, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:
        return repr(arguments)


def _names(call: _Call) -> str:
    return ", ".join(name for name, _ in call)


def _chat_calls(messages: Any) -> Iterator[_Call]:
    if not isinstance(messages, Sequence) or not messages or not _is(messages[-1], "role", "tool"):
        return
    for message in reversed(messages):
        if not isinstance(message, Mapping):
            break
        role = message.get("role")
        if role == "tool":
            continue
        tool_calls = message.get("tool_calls")
        if role != "assistant" or not isinstance(tool_calls, list) or not tool_calls:
            break
        yield tuple(_chat_call(c) for c in tool_calls)


def _chat_call(call: Any) -> tuple[str, str]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        return ("?", repr(call))
    return (str(function.get("name")), _canonical(function.get("arguments")))


def _responses_calls(items: Any) -> Iterator[_Call]:
    if not isinstance(items, Sequence) or isinstance(items, str) or not items:
        return
    if not _is(items[-1], "type", "function_call_output"):
        return
    for item in reversed(items):
        if not isinstance(item, Mapping):
            break
        kind = item.get("type")
        if kind in ("function_call_output", "reasoning"):
            continue
        if kind != "function_call":
            break
        yield ((str(item.get("name")), _canonical(item.get("arguments"))),)


def _messages_calls(messages: Any) -> Iterator[_Call]:
    if not isinstance(messages, Sequence) or not messages or not _holds_results(messages[-1]):
        return
    for message in reversed(messages):
        if not isinstance(message, Mapping):
            break
        if message.get("role") == "user" and _holds_results(message):
            continue
        content = message.get("content")
        uses = [b for b in content if _is(b, "type", "tool_use")] if isinstance(content, list) else []
        if message.get("role") != "assistant" or not uses:
            break
        yield tuple((str(b.get("name")), _canonical(b.get("input"))) for b in uses)


def _holds_results(message: Any) -> bool:
    if not _is(message, "role", "user"):
        return False
    content = message.get("content")
    return isinstance(content, list) and any(_is(b, "type", "tool_result") for b in content)


def _is(value: Any, key: str, wanted: str) -> bool:
    return isinstance(value, Mapping) and value.get(key) == wanted
