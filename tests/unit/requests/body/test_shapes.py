"""Message shapes and request paths: a client's mistake is a 400 naming the field, decided before forwarding."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from adaptive_spec.requests.apis import Api
from adaptive_spec.requests.body.parse import ParsedRequest, RoutedPath, parse_body
from adaptive_spec.requests.body.shapes import RequestProblem
from adaptive_spec.requests.paths import decide_path


def _problem(api: str, body: dict[str, Any]) -> RequestProblem:
    result = parse_body(Api(api), orjson.dumps(body))
    assert isinstance(result, RequestProblem), result
    return result


@pytest.mark.parametrize(
    ("api", "body", "param"),
    [
        ("chat", {"messages": [{"content": "hi"}]}, "messages[0].role"),
        ("chat", {"messages": [{"role": 3, "content": "hi"}]}, "messages[0].role"),
        ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ("chat", {"messages": [{"role": "user"}]}, "messages[0].content"),
        ("chat", {"messages": ["hi"]}, "messages[0]"),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
            "messages[0].content[0].text",
        ),
        ("chat", {"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0].type"),
        (
            "chat",
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": 1}}]}]},
            "messages[0].tool_calls[0].function",
        ),
        ("chat", {"messages": [], "stop": [1]}, "stop"),
        ("chat", {"messages": [], "tools": [{"type": "function", "function": "f"}]}, "tools[0].function"),
        ("chat", {"messages": [], "seed": "1"}, "seed"),
        ("chat", {"messages": [], "tool_choice": 3}, "tool_choice"),
        ("messages", {"messages": [{"role": None, "content": "hi"}]}, "messages[0].role"),
        ("messages", {"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
        (
            "messages",
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "input": "x"}]}]},
            "messages[0].content[0].input",
        ),
        ("messages", {"messages": [], "system": [{"type": "text", "text": None}]}, "system[0].text"),
        ("responses", {"input": [{"role": "user", "content": 1}]}, "input[0].content"),
        ("responses", {"input": [{"type": "function_call", "name": "f", "arguments": {}}]}, "input[0].arguments"),
        ("responses", {"input": [7]}, "input[0]"),
        ("completions", {"prompt": ["a", None]}, "prompt[1]"),
        ("completion", {"prompt": [[1, {"x": 1}]]}, "prompt[0]"),
    ],
)
def test_shape_problems_name_the_field(api: str, body: dict[str, Any], param: str) -> None:
    problem = _problem(api, body)
    assert problem.param == param
    assert param in problem.message


def test_deep_nesting_is_refused_without_recursion() -> None:
    deep = b'{"messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    result = parse_body(Api.CHAT, deep)
    assert isinstance(result, RequestProblem)


def test_nesting_is_refused_from_one_level_past_the_limit() -> None:
    from adaptive_spec.requests.body.shapes import _MAX_NESTING, check_shape

    def body(levels: int) -> dict[str, object]:
        value: object = "leaf"
        for i in range(levels):  # dicts and lists in turn, inside a tool's parameters
            value = {"k": value} if i % 2 else [value]
        tool = {"type": "function", "function": {"name": "f", "parameters": value}}
        return {"messages": [{"role": "user", "content": "hi"}], "tools": [tool]}

    # The body itself, "tools", the tool, "function": four levels above the parameters.
    fits = _MAX_NESTING - 4
    assert check_shape(Api.CHAT, body(fits)) is None
    problem = check_shape(Api.CHAT, body(fits + 1))
    assert problem is not None and "nested deeper than" in problem.message
    empty_at_limit = body(fits)
    assert check_shape(Api.CHAT, {**empty_at_limit, "extra": [[]] * 3}) is None


@pytest.mark.parametrize(
    ("api", "body"),
    [
        (
            "chat",
            {
                "messages": [
                    {"role": "system", "content": "s"},
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "x"},
                            {"type": "image_url", "image_url": {"url": "data:"}},
                        ],
                    },
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
                    },
                    {"role": "tool", "tool_call_id": "c", "content": "ok"},
                ],
                "stop": ["a"],
                "tools": [],
            },
        ),
        (
            "messages",
            {
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "x"}]},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]},
                ],
                "system": "s",
            },
        ),
        (
            "responses",
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_text", "text": "x"}]},
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                    {"type": "function_call_output", "call_id": "c", "output": "ok"},
                ]
            },
        ),
        ("completion", {"prompt": ["a", 1, [2, 3]]}),
        # Unknown but well-formed values pass, as llama-server takes them: roles, part types, item types.
        ("chat", {"messages": [{"role": "wizard", "content": [{"type": "future_part", "x": 1}]}]}),
        (
            "messages",
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "system", "content": [{"type": "text", "text": "env", "cache_control": {"type": "x"}}]},
                    {"role": "user", "content": [{"type": "future_block", "data": {}}]},
                    {"role": "narrator", "content": "b"},
                ],
                "thinking": {"type": "adaptive"},
                "output_config": {"effort": "high"},
                "context_management": {"edits": []},
            },
        ),
        ("responses", {"input": [{"role": "critic", "content": "x"}, {"type": "future_item", "id": 3}]}),
    ],
)
def test_valid_shapes_pass(api: str, body: dict[str, Any]) -> None:
    assert isinstance(parse_body(Api(api), orjson.dumps(body)), ParsedRequest)


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("/v1/chat/completions", RoutedPath(None, "/v1/chat/completions", Api.CHAT)),
        ("/p/proj/v1/chat/completions?x=1", RoutedPath("proj", "/v1/chat/completions", Api.CHAT)),
        ("/v1/chat/completion%73", RoutedPath(None, "/v1/chat/completions", Api.CHAT)),
        ("/tokenize%25", RoutedPath(None, "/tokenize%25", Api.OTHER)),
        ("/p/x", RoutedPath("x", "/", Api.OTHER)),
    ],
)
def test_paths_are_decided_on_the_raw_target(target: str, expected: RoutedPath) -> None:
    assert decide_path(target) == expected


@pytest.mark.parametrize(
    ("target", "code"),
    [
        ("/p/%2e%2e/v1/chat/completions", "invalid_path"),
        ("/p/../v1/chat/completions", "invalid_path"),
        ("/v1/chat/completions/../completions", "invalid_path"),
        ("/p/ok/%2E/v1/models", "invalid_path"),
        ("//127.0.0.1:1/v1/models", "invalid_path"),
        ("http://127.0.0.1:1/v1/models", "invalid_path"),
        ("*", "invalid_path"),
        ("/v1/chat%2Fcompletions", "invalid_path"),
        ("/v1/a%3Fb", "invalid_path"),
        ("/v1/%ff", "invalid_path"),
        ("/v1/%00", "invalid_path"),
        ("/v1//models", "invalid_path"),
        ("/p/-x/v1/models", "invalid_project"),
        ("/p/" + "a" * 200 + "/v1/models", "invalid_project"),
        ("/p", "invalid_project"),
    ],
)
def test_ambiguous_paths_are_refused(target: str, code: str) -> None:
    result = decide_path(target)
    assert isinstance(result, RequestProblem) and result.code == code, result
