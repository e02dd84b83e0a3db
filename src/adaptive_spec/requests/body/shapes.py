"""The shape of the fields llama-server reads without checking (messages, their parts, tool calls, prompts, and
typed options): a client's mistake there is answered 400 naming the field, never llama-server's 500.

Never stricter than llama-server: only the JSON types it reads unchecked are refused. A value it takes as it comes
(a role, a content part's or an input item's type) passes whatever it is, known or not, so the next client's newer
API feature reaches the server (Claude Code's mid-conversation `system` message on /v1/messages is one)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from adaptive_spec.requests.apis import Api


@dataclass(frozen=True, slots=True)
class RequestProblem:
    """Why a request body was refused; the proxy shell turns it into an OpenAI-shaped 400."""

    message: str
    code: str
    param: str | None = None


_MAX_NESTING = 64
# Optional fields any generating API may carry, with the JSON types llama-server reads them as.
_FIELD_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "stop": ((str, list), "a string or an array of strings"),
    "stop_sequences": ((list,), "an array of strings"),
    "tools": ((list,), "an array"),
    "tool_choice": ((str, dict), "a string or an object"),
    "response_format": ((dict,), "an object"),
    "logit_bias": ((dict, list), "an object or an array"),
    "seed": ((int,), "an integer"),
    "top_k": ((int,), "an integer"),
    "min_p": ((int, float), "a number"),
    "presence_penalty": ((int, float), "a number"),
    "frequency_penalty": ((int, float), "a number"),
    "repeat_penalty": ((int, float), "a number"),
    "grammar": ((str,), "a string"),
    "json_schema": ((dict,), "an object"),
    "chat_template_kwargs": ((dict,), "an object"),
    "parallel_tool_calls": ((bool,), "a boolean"),
    "cache_prompt": ((bool,), "a boolean"),
    "id_slot": ((int,), "an integer"),
    "n_probs": ((int,), "an integer"),
    "samplers": ((list, str), "an array of strings or a string"),
    "lora": ((list,), "an array"),
    "instructions": ((str,), "a string"),
    "system": ((str, list), "a string or an array of text blocks"),
    "reasoning_format": ((str,), "a string"),
}


def check_shape(api: Api, body: Mapping[str, Any]) -> RequestProblem | None:
    """The first problem of a parsed body's shape, or None; `parse_body` has checked the top-level field types."""
    problem = _nesting(body) or _fields(body)
    if problem is not None:
        return problem
    check: Callable[[Mapping[str, Any]], RequestProblem | None] | None = _CHECKS.get(api)
    return check(body) if check is not None else None


def _problem(param: str, message: str) -> RequestProblem:
    return RequestProblem(f"Invalid '{param}': {message}", "invalid_value", param)


def _nesting(value: Any) -> RequestProblem | None:
    # Level by level, iterative: a body nested thousands deep must not exhaust the stack here, nor reach
    # llama-server. Only containers are visited (a leaf cannot nest; a long history is mostly strings), and exact
    # types are tested (a parsed body holds only dicts and lists): 4x faster than a stack of (item, depth) pairs.
    level = [value] if type(value) in _CONTAINERS else []
    depth = 0
    while level:
        if depth >= _MAX_NESTING and any(level):  # a value nested deeper than the limit
            return RequestProblem(f"The request body is nested deeper than {_MAX_NESTING} levels.", "invalid_value")
        deeper = []
        for item in level:
            for v in item.values() if type(item) is dict else item:
                if type(v) in _CONTAINERS:
                    deeper.append(v)
        level = deeper
        depth += 1
    return None


_CONTAINERS = frozenset({dict, list})


def _fields(body: Mapping[str, Any]) -> RequestProblem | None:
    for name, (types, wanted) in _FIELD_TYPES.items():
        value = body.get(name)
        if value is None:
            continue
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            return _problem(name, f"expected {wanted}.")
    stop = body.get("stop")
    if isinstance(stop, list) and not all(isinstance(s, str) for s in stop):
        return _problem("stop", "expected a string or an array of strings.")
    for name in ("tools", "stop_sequences"):
        items = body.get(name)
        kind = dict if name == "tools" else str
        if isinstance(items, list) and not all(isinstance(t, kind) for t in items):
            return _problem(name, "expected an array of objects." if kind is dict else "expected an array of strings.")
    return _tools(body.get("tools"))


def _tools(tools: Any) -> RequestProblem | None:
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        function = tool.get("function")
        if function is not None and (not isinstance(function, dict) or not isinstance(function.get("name"), str)):
            return _problem(f"tools[{i}].function", "expected an object with a string 'name'.")
        problem = _strings(f"tools[{i}]", tool, ("type", "name", "description"))
        if problem is None and isinstance(function, dict):
            problem = _strings(f"tools[{i}].function", function, ("description",))
        if problem is not None:
            return problem
        for key in ("parameters", "input_schema"):
            schema = tool.get(key, (function or {}).get(key) if isinstance(function, dict) else None)
            if schema is not None and not isinstance(schema, dict):
                return _problem(f"tools[{i}].{key}", "expected an object (a JSON schema).")
    return None


def _text_parts(param: str, parts: list[Any], text_types: frozenset[str]) -> RequestProblem | None:
    for j, part in enumerate(parts):
        where = f"{param}[{j}]"
        if not isinstance(part, dict):
            return _problem(where, "expected a content part object.")
        kind = part.get("type")
        if not isinstance(kind, str):
            return _problem(f"{where}.type", "expected a string.")
        if kind in text_types and not isinstance(part.get("text"), str):
            return _problem(f"{where}.text", "expected a string.")
    return None


def _content(param: str, content: Any, text_types: frozenset[str], optional: bool) -> RequestProblem | None:
    if content is None and optional:
        return None
    if isinstance(content, str):
        return None
    if isinstance(content, list):
        return _text_parts(param, content, text_types)
    return _problem(param, "expected a string or an array of content parts.")


def _role(param: str, message: Any) -> RequestProblem | None:
    # Any role string passes: the chat template decides what an unknown one means (llama-server refuses none).
    if not isinstance(message, dict):
        return _problem(param, "expected a message object.")
    if not isinstance(message.get("role"), str):
        return _problem(f"{param}.role", "every message needs a 'role' string.")
    return None


_CHAT_TEXT = frozenset({"text"})


def _chat(body: Mapping[str, Any]) -> RequestProblem | None:
    for i, message in enumerate(body["messages"]):
        where = f"messages[{i}]"
        problem = _role(where, message)
        if problem is not None:
            return problem
        calls = message.get("tool_calls")
        # `null` content is empty content to llama-server, whatever the role; only a missing one it refuses (but on
        # an assistant turn, which may carry only tool calls).
        problem = _content(f"{where}.content", message.get("content"), _CHAT_TEXT, optional=True)
        if problem is None and "content" not in message and message["role"] != "assistant":
            problem = _problem(f"{where}.content", "every non-assistant message needs 'content'.")
        problem = problem or _strings(where, message, ("name", "tool_call_id", "reasoning_content"))
        problem = problem or _tool_calls(f"{where}.tool_calls", calls)
        if problem is not None:
            return problem
    return None


def _strings(where: str, item: Mapping[str, Any], keys: tuple[str, ...]) -> RequestProblem | None:
    for key in keys:
        if item.get(key) is not None and not isinstance(item[key], str):
            return _problem(f"{where}.{key}", "expected a string.")
    return None


def _tool_calls(where: str, calls: Any) -> RequestProblem | None:
    if calls is None:
        return None
    if not isinstance(calls, list):
        return _problem(where, "expected an array.")
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return _problem(f"{where}[{k}].function", "expected an object with a string 'name'.")
        if call.get("type") != "function":
            return _problem(f"{where}[{k}].type", "expected 'function'.")
        if not isinstance(function.get("arguments"), str | dict):
            return _problem(f"{where}[{k}].function.arguments", "expected a string (JSON).")
        if call.get("id") is not None and not isinstance(call["id"], str):
            return _problem(f"{where}[{k}].id", "expected a string.")
    return None


_ANTHROPIC_TEXT = frozenset({"text"})


def _anthropic(body: Mapping[str, Any]) -> RequestProblem | None:
    system = body.get("system")
    if isinstance(system, list):
        problem = _text_parts("system", system, _ANTHROPIC_TEXT)
        if problem is not None:
            return problem
    for i, message in enumerate(body["messages"]):
        where = f"messages[{i}]"
        problem = _role(where, message) or _content(
            f"{where}.content", message.get("content"), _ANTHROPIC_TEXT, optional=False
        )
        if problem is not None:
            return problem
        for j, block in enumerate(message["content"] if isinstance(message["content"], list) else []):
            problem = _anthropic_block(f"{where}.content[{j}]", block)
            if problem is not None:
                return problem
    return None


def _anthropic_block(where: str, block: Mapping[str, Any]) -> RequestProblem | None:
    kind = block["type"]
    if kind == "tool_use":
        if not isinstance(block.get("input", {}), dict):
            return _problem(f"{where}.input", "expected an object.")
        return _strings(where, block, ("id", "name"))
    if kind == "tool_result":
        problem = _strings(where, block, ("tool_use_id",))
        content = block.get("content")
        if problem is None and content is not None:
            problem = _content(f"{where}.content", content, _ANTHROPIC_TEXT, optional=True)
        return problem
    if kind == "image" and not isinstance(block.get("source"), dict):
        return _problem(f"{where}.source", "expected an object.")
    return None


_RESPONSES_TEXT = frozenset({"input_text", "output_text", "text"})


def _responses(body: Mapping[str, Any]) -> RequestProblem | None:
    items = body["input"]
    for i, item in enumerate(items if isinstance(items, list) else []):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            return _problem(where, "expected an input item object.")
        kind = item.get("type", "message")
        if not isinstance(kind, str):
            return _problem(f"{where}.type", "expected a string.")
        if kind == "message" or "role" in item:
            problem = _role(where, item) or _content(
                f"{where}.content", item.get("content"), _RESPONSES_TEXT, optional=False
            )
        elif kind == "function_call":
            problem = _strings(where, item, ("call_id", "name", "arguments"))
        elif kind == "function_call_output":
            problem = _strings(where, item, ("call_id",)) or _content(
                f"{where}.output", item.get("output"), _RESPONSES_TEXT, optional=False
            )
        else:
            problem = None
        if problem is not None:
            return problem
    return None


def _prompt(body: Mapping[str, Any]) -> RequestProblem | None:
    prompt = body["prompt"]
    if not isinstance(prompt, list):
        return None
    for i, piece in enumerate(prompt):
        tokens = piece if isinstance(piece, list) else [piece]
        if not all(isinstance(t, str | int) and not isinstance(t, bool) for t in tokens):
            return _problem(f"prompt[{i}]", "expected a string, a token id, or an array of them.")
    return None


_CHECKS: dict[Api, Callable[[Mapping[str, Any]], RequestProblem | None]] = {
    Api.CHAT: _chat,
    Api.MESSAGES: _anthropic,
    Api.RESPONSES: _responses,
    Api.COMPLETIONS: _prompt,
    Api.COMPLETION: _prompt,
}
