"""An agent's loop on one tool call, found in each API's history, and the body that breaks it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from adaptive_spec.requests.apis import Api
from adaptive_spec.requests.body.repeats import RepeatedCall, guard, trailing_repeat

WRITE = {"name": "write", "arguments": '{"filePath": "hello.py", "content": "Hello world!"}'}
# The same arguments, its keys in another order and spaced differently: the same call.
WRITE_REORDERED = {"name": "write", "arguments": '{"content":"Hello world!","filePath":"hello.py"}'}
READ = {"name": "read", "arguments": '{"filePath": "hello.py"}'}


def _chat(*calls: dict[str, str], end_with_user: bool = False) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "tools"}, {"role": "user", "content": "go"}]
    for i, call in enumerate(calls):
        cid = f"call_{i}"
        messages.append({"role": "assistant", "content": "", "tool_calls": [{"id": cid, "function": call}]})
        messages.append({"role": "tool", "tool_call_id": cid, "content": "Wrote file successfully."})
    if end_with_user:
        messages.append({"role": "user", "content": "again please"})
    return {"messages": messages, "tools": [{"type": "function", "function": {"name": "write"}}]}


def _responses(*calls: dict[str, str]) -> dict[str, Any]:
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]}
    ]
    for i, call in enumerate(calls):
        items.append({"type": "reasoning", "summary": []})
        items.append({"type": "function_call", "call_id": f"c{i}", **call})
        items.append({"type": "function_call_output", "call_id": f"c{i}", "output": "Unknown process id 0"})
    return {"input": items, "tools": [{"type": "function", "name": "write"}]}


def _messages(*calls: dict[str, str]) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    for i, call in enumerate(calls):
        use = {"type": "tool_use", "id": f"t{i}", "name": call["name"], "input": json.loads(call["arguments"])}
        messages.append({"role": "assistant", "content": [use]})
        messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{i}", "content": "ok"}]})
    return {"messages": messages, "max_tokens": 64}


@pytest.mark.parametrize("shape", [_chat, _responses, _messages], ids=["chat", "responses", "messages"])
def test_the_trailing_run_of_one_call_is_counted(shape: Any) -> None:
    api = {_chat: Api.CHAT, _responses: Api.RESPONSES, _messages: Api.MESSAGES}[shape]
    assert trailing_repeat(api, shape(READ, WRITE, WRITE_REORDERED, WRITE)) == RepeatedCall("write", 3)
    assert trailing_repeat(api, shape(WRITE, READ)) is None  # different calls are work, not a loop
    assert trailing_repeat(api, shape(WRITE)) is None  # once is no repeat
    assert trailing_repeat(api, shape(WRITE, WRITE, READ, READ)) == RepeatedCall("read", 2)


def test_a_person_speaking_since_ends_the_loop() -> None:
    assert trailing_repeat(Api.CHAT, _chat(WRITE, WRITE, WRITE, end_with_user=True)) is None


def test_other_apis_and_odd_bodies_are_left_alone() -> None:
    assert trailing_repeat(Api.COMPLETIONS, {"prompt": "x"}) is None
    assert trailing_repeat(Api.CHAT, {"messages": "not a list"}) is None
    assert trailing_repeat(Api.RESPONSES, {"input": "a string"}) is None
    odd = _chat(WRITE, WRITE)
    odd["messages"][-2]["tool_calls"] = [{"function": "not an object"}, {}]
    assert trailing_repeat(Api.CHAT, odd) is None


def test_the_note_comes_first_then_a_text_answer() -> None:
    two, three = _chat(WRITE, WRITE), _chat(WRITE, WRITE, WRITE)
    assert guard(Api.CHAT, two, RepeatedCall("write", 2), note_after=3, text_after=4) is None
    noted = guard(Api.CHAT, two, RepeatedCall("write", 2), note_after=2, text_after=3)
    assert noted is not None and not noted.text_only
    assert noted.body["messages"][:-1] == two["messages"]  # the history as the client sent it: its cache stays
    assert noted.body["messages"][-1]["role"] == "user" and "write" in noted.body["messages"][-1]["content"]
    assert "tool_choice" not in noted.body
    text = guard(Api.CHAT, three, RepeatedCall("write", 3), note_after=2, text_after=3)
    assert text is not None and text.text_only and text.body["tool_choice"] == "none"
    assert text.body["tools"] == three["tools"]  # the tools stay rendered: the prompt's cached prefix stays too
    assert text.describe() == "write ×3 in a row, same arguments: note added, text answer asked"
    assert guard(Api.CHAT, three, RepeatedCall("write", 3), note_after=0, text_after=0) is None


def test_a_required_call_is_never_turned_into_text() -> None:
    body = {**_chat(WRITE, WRITE, WRITE), "tool_choice": "required"}
    guarded = guard(Api.CHAT, body, RepeatedCall("write", 3), note_after=2, text_after=3)
    assert guarded is not None and not guarded.text_only and guarded.body["tool_choice"] == "required"


def test_responses_and_messages_get_the_note_in_their_own_shape() -> None:
    responses = guard(Api.RESPONSES, _responses(WRITE, WRITE, WRITE), RepeatedCall("write", 3), 2, 3)
    assert responses is not None and responses.text_only and responses.body["tool_choice"] == "none"
    assert responses.body["input"][-1]["content"][0]["type"] == "input_text"
    body = _messages(WRITE, WRITE, WRITE)
    messages = guard(Api.MESSAGES, body, RepeatedCall("write", 3), 2, 3)
    # The note inside the last user message (the API wants user and assistant turns to alternate), and a text answer
    # asked in Anthropic's words (a patched llama-server maps it to "none"; a stock one ignores it).
    assert messages is not None and messages.text_only and messages.body["tool_choice"] == {"type": "none"}
    last = messages.body["messages"][-1]
    assert last["role"] == "user" and [b["type"] for b in last["content"]] == ["tool_result", "text"]
    assert body["messages"][-1]["content"] == [b for b in last["content"] if b["type"] == "tool_result"]


def test_an_anthropic_choice_of_a_call_is_kept() -> None:
    for choice in ({"type": "any"}, {"type": "tool", "name": "write"}):
        body = {**_messages(WRITE, WRITE, WRITE), "tool_choice": choice}
        guarded = guard(Api.MESSAGES, body, RepeatedCall("write", 3), 2, 3)
        assert guarded is not None and not guarded.text_only and guarded.body["tool_choice"] == choice
    auto = guard(
        Api.MESSAGES,
        {**_messages(WRITE, WRITE, WRITE), "tool_choice": {"type": "auto"}},
        RepeatedCall("write", 3),
        2,
        3,
    )
    assert auto is not None and auto.body["tool_choice"] == {"type": "none"}


def test_a_long_run_of_different_calls_is_read_only_to_the_first_difference(monkeypatch: pytest.MonkeyPatch) -> None:
    # An agent's turn after 200 different calls (each with a file's content) is on the request path: the history's
    # calls are not all parsed.
    from adaptive_spec.requests.body import repeats

    read: list[Any] = []
    canonical = repeats._canonical

    def counted(arguments: Any) -> str:
        read.append(arguments)
        return canonical(arguments)

    monkeypatch.setattr(repeats, "_canonical", counted)
    calls = [
        {"name": "write", "arguments": json.dumps({"path": f"f{i}.py", "content": "x" * 1000})} for i in range(200)
    ]
    assert trailing_repeat(Api.CHAT, _chat(*calls, calls[-1])) == RepeatedCall("write", 2)
    assert len(read) == 3
    read.clear()
    assert trailing_repeat(Api.CHAT, _chat(*calls)) is None
    assert len(read) == 2
