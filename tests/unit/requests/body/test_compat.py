"""Shapes an agent sends that llama-server refuses, rewritten into ones it takes."""

from __future__ import annotations

from typing import Any

from adaptive_spec.requests.apis import Api
from adaptive_spec.requests.body.compat import repaired

GOAL = {"type": "function_call_output", "name": "goal_objective", "namespace": "agent", "output": "Create hello.py."}
CALL = {"type": "function_call", "name": "create_goal", "arguments": "{}", "call_id": "c1"}
ANSWER = {"type": "function_call_output", "call_id": "c1", "output": "{}"}


def _body(*items: dict[str, Any]) -> dict[str, Any]:
    return {"model": "local", "input": [{"type": "message", "role": "user", "content": "go"}, *items]}


def test_a_call_less_output_becomes_a_user_message_and_the_rest_stays() -> None:
    body = _body(CALL, ANSWER, GOAL)
    fixed = repaired(Api.RESPONSES, body)
    assert fixed is not None
    assert fixed.body["input"][:3] == body["input"][:3]  # the cached prefix as sent
    assert fixed.body["input"][3] == {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "goal_objective: Create hello.py."}],
    }
    assert fixed.body["model"] == "local" and "goal_objective" in fixed.note
    assert body["input"][3] is GOAL  # the client's body is not changed


def test_a_structured_output_is_kept_as_json_text() -> None:
    fixed = repaired(Api.RESPONSES, _body({"type": "function_call_output", "output": [{"type": "input_text"}]}))
    assert fixed is not None
    assert fixed.body["input"][1]["content"][0]["text"] == 'tool output: [{"type":"input_text"}]'


def test_bodies_llama_server_takes_are_left_alone() -> None:
    assert repaired(Api.RESPONSES, _body(CALL, ANSWER)) is None
    assert repaired(Api.RESPONSES, {"input": "a string"}) is None
    assert repaired(Api.CHAT, {"messages": [GOAL]}) is None
