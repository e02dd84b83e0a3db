"""What the proxy reads of Claude Code's bodies as llama-server reads them: the billing line's per-request value,
the session id in `metadata.user_id`, and a context overflow worded as Anthropic words it."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from adaptive_spec.requests.apis import Api
from adaptive_spec.requests.body.compat import anthropic_overflow
from adaptive_spec.routing.prompt.pieces import prompt_pieces
from adaptive_spec.routing.prompt.prefix import estimate
from adaptive_spec.sessions.grouping import SessionRegistry, explicit_session
from adaptive_spec.sessions.messages import normalised_billing_line, normalised_system, system_entries

LINE = "x-anthropic-billing-header: cc_version=2.1.328.a1b; cc_entrypoint=sdk-cli; cch={};"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (LINE.format("1a2b3"), LINE.format("fffff")),
        (LINE.format("1a2b3") + "You are a coding agent.", LINE.format("fffff") + "You are a coding agent."),
        (LINE.format("00000"), LINE.format("fffff")),
        (LINE.format("1a2b"), LINE.format("1a2b")),  # not five characters then ';': llama-server keeps it too
        (LINE.format("1a2b3")[:-1], LINE.format("1a2b3")[:-1]),  # no ';' after the value
        ("x-anthropic-billing-header: cc_version=2.1.328; cc_entrypoint=cli;", None),  # no cch
        ("You are helpful. x-anthropic-billing-header: cch=1a2b3;", None),  # not the block's start
        ("cch=1a2b3;", None),
    ],
)
def test_the_billing_value_is_normalised_as_llama_server_does(text: str, expected: str | None) -> None:
    assert normalised_billing_line(text) == (text if expected is None else expected)


def _claude_body(cch: str, user: str = "Create hello.py.") -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 32000,
        "system": [
            {"type": "text", "text": LINE.format(cch)},
            {"type": "text", "text": "You are a coding agent. " * 40, "cache_control": {"type": "ephemeral"}},
        ],
        "tools": [{"name": "Write", "description": "Write a file.", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": user}]},
            {"role": "system", "content": "Environment: a scratch repository."},
        ],
    }


def test_a_changed_billing_value_leaves_the_system_text_and_pieces_the_same() -> None:
    one, two = _claude_body("1a2b3"), _claude_body("9f8e7")
    assert list(system_entries(one)) == list(system_entries(two))
    assert prompt_pieces(one) == prompt_pieces(two)
    assert normalised_system(one["system"])[1] is one["system"][1]  # the other blocks are not copied
    assert normalised_system(one["system"]) != one["system"]  # ... and the client's body is left as it was
    assert one["system"][0]["text"] == LINE.format("1a2b3")
    other = _claude_body("1a2b3", user="Something else entirely.")
    assert prompt_pieces(one) != prompt_pieces(other)


def test_a_changed_billing_value_is_neither_a_new_prompt_nor_a_side_request() -> None:
    from adaptive_spec.routing.prompt.prefix import observe
    from adaptive_spec.telemetry.records import Timings

    first = _claude_body("1a2b3")
    pieces = prompt_pieces(first)
    state = observe(None, pieces, True, "Done.", Timings(prompt_n=900, cache_n=0, predicted_n=3))
    follow = _claude_body("77c0d")
    follow["messages"] += [
        {"role": "assistant", "content": [{"type": "text", "text": "Done."}]},
        {"role": "user", "content": [{"type": "text", "text": "Now change it to print bye."}]},
    ]
    got = estimate(state, prompt_pieces(follow), True, state.chars_per_token)
    assert not got.side
    assert got.shared_tokens >= 890 and got.new_tokens < 60, got


@pytest.mark.parametrize(
    ("user_id", "expected"),
    [
        (json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": "3f1c-aa"}), "3f1c-aa"),
        ("user_abc_account_123_session_3f1c-bb", "3f1c-bb"),
        (json.dumps({"device_id": "d"}), None),
        ("{not json", None),
        (json.dumps(["session_id"]), None),
        ("", None),
    ],
)
def test_claude_codes_session_id_in_metadata_user_id(user_id: str, expected: str | None) -> None:
    found = explicit_session({}, {"metadata": {"user_id": user_id}})
    assert (found[0] if found else None) == expected
    if expected is not None:
        assert found is not None and found[1] == "body:metadata.user_id"


def test_the_session_header_comes_before_the_body() -> None:
    body = {"metadata": {"user_id": json.dumps({"session_id": "from-body"})}}
    got = SessionRegistry().assign({"x-claude-code-session-id": "from-header"}, body)
    assert (got.session_id, got.source) == ("from-header", "header:x-claude-code-session-id")


def _overflow(**extra: Any) -> bytes:
    error = {"code": 400, "message": "request (40000 tokens) exceeds the available context size (32768 tokens)"}
    return orjson.dumps({"error": {**error, "type": "exceed_context_size_error", **extra}})


def test_an_overflow_is_worded_as_anthropic_words_it() -> None:
    got = anthropic_overflow(_overflow(n_prompt_tokens=40000, n_ctx=32768))
    assert got == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "prompt is too long: 40000 tokens > 32768 maximum"},
    }


@pytest.mark.parametrize(
    "body",
    [
        _overflow(),  # no counts: nothing to say in Anthropic's words
        _overflow(n_prompt_tokens="40000", n_ctx=32768),
        _overflow(n_prompt_tokens=True, n_ctx=32768),
        orjson.dumps({"error": {"type": "invalid_request_error", "message": "x", "n_prompt_tokens": 1, "n_ctx": 1}}),
        b"not json",
        b"[]",
    ],
)
def test_anything_else_is_not_an_overflow(body: bytes) -> None:
    assert anthropic_overflow(body) is None


def test_an_anthropic_tool_use_counts_as_the_call_the_template_writes() -> None:
    from adaptive_spec.sessions.messages import message_entry

    use = {"type": "tool_use", "id": "toolu_1", "name": "Write", "input": {"file_path": "hello.py", "content": "x"}}
    role, assistant, text, calls = message_entry({"role": "assistant", "content": [use]}, spaced=True)
    assert (role, assistant, calls) == ("assistant", True, True)
    assert text == '{"name": "Write", "arguments": {"file_path": "hello.py", "content": "x"}}'
    said = {"role": "assistant", "content": [{"type": "text", "text": "Writing it."}, use]}
    assert message_entry(said)[2].startswith('Writing it.\n{"name": "Write"')
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "done"}]}
    assert message_entry(result)[2:] == ("done", False)


def test_a_tool_use_is_spaced_only_when_asked_as_a_chat_tool_call_is() -> None:
    """Unspaced (for the digests, which ignore whitespace, on the request path): the input compact, as a chat call's
    arguments come from the client; spaced (what the statistics tokenize): as the template writes either."""
    from adaptive_spec.sessions.messages import message_digest, message_entry

    use = {"type": "tool_use", "id": "toolu_1", "name": "Write", "input": {"file_path": "hello.py", "content": "é"}}
    anthropic = {"role": "assistant", "content": [use]}
    arguments = '{"file_path":"hello.py","content":"é"}'
    chat = {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "Write", "arguments": arguments}}]}
    unspaced, spaced = message_entry(anthropic)[2], message_entry(anthropic, spaced=True)[2]
    assert unspaced == '{"name": "Write", "arguments": ' + arguments + "}" == message_entry(chat)[2]
    assert spaced == '{"name": "Write", "arguments": {"file_path": "hello.py", "content": "é"}}'
    assert spaced == message_entry(chat, spaced=True)[2]
    assert message_digest("assistant", unspaced) == message_digest("assistant", spaced)


@pytest.mark.parametrize("role", ["system", "user", "tool", "assistant"])
def test_null_content_passes_as_llama_server_takes_it(role: str) -> None:
    """llama-server b11434 answers `content: null` as empty content on any role (measured: 200 on chat/completions);
    a missing `content` it refuses on a non-assistant message (400), and so does the proxy."""
    from adaptive_spec.requests.body.shapes import check_shape

    message: dict[str, Any] = {"role": role, "content": None}
    assert check_shape(Api.CHAT, {"messages": [message]}) is None
    missing = check_shape(Api.CHAT, {"messages": [{"role": role}]})
    assert (missing is None) == (role == "assistant")
