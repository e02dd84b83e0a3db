"""A request's messages as the session code reads them: their texts, tool calls and digests, system prompt first.

Pure. The grouping, the statistics and the routing's prompt pieces read a body through these, so each sees the same
text for a message: its content's text parts, its tool calls as the model wrote them (`call_text`), and Anthropic's
`system` with Claude Code's attribution line as llama-server renders it (`normalised_system`).

Claude Code (2.1 and later) opens `system` with a text block `x-anthropic-billing-header: cc_version=…;
cc_entrypoint=…; cch=1a2b3;` whose `cch` value changes with every request. llama-server writes `fffff` in its place
(tools/server/server-chat.cpp, llama.cpp PR #21793), so its cached prefix holds from one turn to the next; the
proxy's digests of a prompt see the same text, else every turn would look like a new prompt and a side request.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from typing import Any

import orjson

from adaptive_spec.streams.output import call_text

# What str.split() splits ASCII text on: deleting these bytes gives the same text as joining its split words.
_ASCII_SPACE = b" \t\n\r\x0b\x0c\x1c\x1d\x1e\x1f"


def text_digest(text: str) -> bytes:
    """A served reply's digest: its words, whitespace aside."""
    return _digest(" ".join(text.split()))


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=12).digest()


def message_text(content: Any) -> str:
    """The text of a message's content: a string, or the text parts of a list (OpenAI, Responses, Anthropic)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict):
                text = part.get("text") or part.get("content")
                if isinstance(text, str):
                    parts.append(text)
        return "\n".join(parts)
    return ""


def messages_of(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Chat `messages`, or Responses-API `input` items, as a list of dicts (a string input is one user turn)."""
    raw = body.get("messages")
    if raw is None:
        raw = body.get("input")
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    return [m for m in raw if isinstance(m, dict)] if isinstance(raw, list) else []


def same_start(messages: Sequence[Any], before: Sequence[Any]) -> int:
    """How many leading messages are equal to `before`'s (parsed values: a memcmp of each text, no hash). One C-level
    comparison when the whole shorter list is (a session's next turn), else one by one up to the first that
    differs."""
    n = min(len(messages), len(before))
    if list(messages[:n]) == list(before[:n]):
        return n
    same = 0
    for new, old in zip(messages, before, strict=False):
        if new is not old and new != old:
            break
        same += 1
    return same


def tool_call_ids(message: Mapping[str, Any]) -> list[str]:
    ids = []
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        ids += [c["id"] for c in calls if isinstance(c, dict) and isinstance(c.get("id"), str)]
    for key in ("tool_call_id", "call_id"):
        if isinstance(message.get(key), str):
            ids.append(message[key])
    content = message.get("content")
    if isinstance(content, list):  # Anthropic tool_use / tool_result blocks
        for block in content:
            if isinstance(block, dict):
                for key in ("id", "tool_use_id"):
                    if block.get("type") in ("tool_use", "tool_result") and isinstance(block.get(key), str):
                        ids.append(block[key])
    return ids


def _tool_text(message: Mapping[str, Any], spaced: bool = False) -> str:
    """A message's tool calls as the model wrote them (`call_text`, what the served reply reads as; their arguments
    spaced as the template writes them when `spaced`), or the result a tool returned."""
    parts = []
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                parts.append(call_text(function.get("name"), function["arguments"], spaced=spaced))
    if isinstance(message.get("arguments"), str):  # a Responses-API function_call item
        parts.append(call_text(message.get("name"), message["arguments"], spaced=spaced))
    if isinstance(message.get("output"), str):  # a function_call_output item
        parts.append(message["output"])
    content = message.get("content")
    for block in content if type(content) is list else ():  # Anthropic tool_use blocks: llama-server renders each
        if isinstance(block, dict) and block.get("type") == "tool_use":  # as a call, its input as `tojson` writes it
            parts.append(call_text(block.get("name"), _input_text(block.get("input", {}), spaced), spaced=False))
    return "\n".join(parts)


def _input_text(value: Any, spaced: bool) -> str:
    """A tool_use block's input as JSON: spaced as the template's `tojson` writes it, else compact (what ignores
    whitespace; an order of magnitude cheaper, as `call_text`'s unspaced arguments are)."""
    if not spaced:
        try:
            return orjson.dumps(value).decode()
        except TypeError:  # orjson's JSONEncodeError: what it does not write (an integer past 64 bits)
            pass
    return json.dumps(value, ensure_ascii=False)


def _uses_tools(content: Any) -> bool:
    """Whether an Anthropic message's content holds tool_use blocks."""
    return type(content) is list and any(isinstance(b, dict) and b.get("type") == "tool_use" for b in content)


def message_digest(role: str, text: str) -> bytes:
    """The digest `context_messages` gives a message of this role and text (whitespace does not count)."""
    if text.isascii():  # most prompts: whitespace deleted in C, ~10x faster than splitting into words
        data = role.encode("utf-8", "surrogatepass") + b"\0" + text.encode("ascii").translate(None, _ASCII_SPACE)
        return hashlib.blake2b(data, digest_size=12).digest()
    return _digest(role + "\0" + "".join(text.split()))


def message_key(role: str, text: str) -> int:
    """A cheap fingerprint of a message, valid in this process only (Python's keyed string hash, ~10x cheaper than
    `message_digest`): with the text's length, what tells that a message is the one a digest was made of."""
    return hash((role, text))


def context_texts(body: Mapping[str, Any]) -> Iterator[tuple[str, bool, str]]:
    """A request's context as (role, written by the assistant, text), system prompt first."""
    for role, assistant, text, _ in context_entries(body):
        yield role, assistant, text


def context_entries(body: Mapping[str, Any], spaced: Container[int] = ()) -> Iterator[tuple[str, bool, str, bool]]:
    """`context_texts`, each with whether the message holds tool calls (the template frames those otherwise). The
    calls of the entries whose index is in `spaced` have their arguments spaced as the template writes them (what
    the session statistics tokenize); the others as the client sent them (the digests ignore whitespace)."""
    i = -1
    for entry in system_entries(body):
        i += 1
        yield entry
    for message in messages_of(body):
        i += 1
        yield message_entry(message, i in spaced)


def system_entries(body: Mapping[str, Any]) -> Iterator[tuple[str, bool, str, bool]]:
    """The entries of a system prompt kept apart from the messages (Responses `instructions`, Anthropic `system`,
    its billing line's per-request value normalised as llama-server does: `normalised_system`)."""
    text = message_text(body.get("instructions"))
    if text:
        yield "system", False, text, False
    text = message_text(normalised_system(body.get("system")))
    if text:
        yield "system", False, text, False


def message_entry(message: Mapping[str, Any], spaced: bool = False) -> tuple[str, bool, str, bool]:
    """One message's `context_entries` entry: (role, written by the assistant, text, holds tool calls)."""
    role = message.get("role") or message.get("type") or ""
    if type(role) is not str:
        role = str(role)
    content = message.get("content")
    text = content if type(content) is str else message_text(content)
    calls = False
    if "tool_calls" in message or "arguments" in message or "output" in message or _uses_tools(content):
        tools = _tool_text(message, spaced)
        calls = bool(tools) and "output" not in message
        text = (text + "\n" + tools if text else tools) if tools else text
    return role, role in _ASSISTANT_ROLES, text, calls


_ASSISTANT_ROLES = frozenset(("assistant", "function_call", "custom_tool_call"))


def context_messages(
    body: Mapping[str, Any], digest: Callable[[str, str], bytes] | None = None
) -> list[tuple[bytes, bool, str]]:
    """A request's context as (digest, written by the assistant, text), system prompt first. `digest`: a stand-in
    for `message_digest` that gives the same digests (one that remembers a session's, see `KnownDigests`)."""
    digest = digest or message_digest
    return [(digest(role, text), assistant, text) for role, assistant, text in context_texts(body)]


class KnownDigests:
    """`message_digest` for one session's turns, remembering the last turn's: a message whose role, length and
    `message_key` equal one seen then takes its digest (the key reads the text once, ~4x cheaper than the digest),
    so a turn digests only its new messages. Call `turn()` after each request to forget what it did not carry."""

    __slots__ = ("_now", "_then")

    def __init__(self) -> None:
        self._then: dict[tuple[str, int, int], bytes] = {}
        self._now: dict[tuple[str, int, int], bytes] = {}

    def __call__(self, role: str, text: str) -> bytes:
        key = (role, len(text), message_key(role, text))
        found = self._then.get(key) or self._now.get(key) or message_digest(role, text)
        self._now[key] = found
        return found

    def turn(self) -> None:
        self._then, self._now = self._now, {}


_BILLING_LINE = "x-anthropic-billing-header:"
_CCH = "cch="
_CCH_CHARS = 5


def normalised_billing_line(text: str) -> str:
    """A system text block as llama-server renders it: the five characters after `cch=` become `fffff` when a `;`
    follows them, in a block that starts with the attribution line; any other text is kept as it is."""
    if not text.startswith(_BILLING_LINE):
        return text
    at = text.find(_CCH, len(_BILLING_LINE))
    if at < 0:
        return text
    start = at + len(_CCH)
    end = start + _CCH_CHARS
    if end < len(text) and text[end] == ";":
        return text[:start] + "f" * _CCH_CHARS + text[end:]
    return text  # not the shape llama-server rewrites: it keeps it as it is too


def normalised_system(system: Any) -> Any:
    """Anthropic's `system` (a string or text blocks) with each block's billing line normalised (a copy only when
    there is one)."""
    if isinstance(system, str):
        return normalised_billing_line(system)
    if not isinstance(system, list) or not any(_billing_block(b) for b in system):
        return system
    return [{**b, "text": normalised_billing_line(b["text"])} if _billing_block(b) else b for b in system]


def _billing_block(block: Any) -> bool:
    return isinstance(block, dict) and isinstance(block.get("text"), str) and block["text"].startswith(_BILLING_LINE)
