from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import pytest

from adaptive_spec.sessions.grouping import SessionRegistry
from adaptive_spec.sessions.project import resolve_project
from adaptive_spec.streams.output import body_output
from tests.support.processes.outside import agent_traffic


def _recorded() -> list[dict[str, Any]]:
    records = []
    for path in sorted(agent_traffic().glob("*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(records, key=lambda r: r["ts"])


def _served(response: dict[str, Any]) -> tuple[str, list[str]]:
    """What the recording server answered, in the shape a real response body has."""
    body = {"choices": [{"message": response["message"]}]} if "message" in response else response
    texts, ids = body_output(body)
    return "".join(texts), ids


def test_recorded_agents_are_grouped_exactly_by_their_real_sessions() -> None:
    registry = SessionRegistry()
    by_truth: dict[str, set[str]] = defaultdict(set)
    sources: dict[str, set[str]] = defaultdict(set)
    for record in _recorded():
        if record["truth"]["kind"] == "models_list" or not isinstance(record.get("body"), dict):
            continue
        headers = {k.lower(): v for k, v in record["headers"].items()}
        assigned = registry.assign(headers, record["body"])
        by_truth[record["truth"]["session"]].add(assigned.session_id)
        sources[record["agent"]].add(assigned.source.split(":")[0])
        text, ids = _served(record["response"])
        registry.note_reply(assigned.session_id, text, ids)
    assert len(by_truth) >= 8
    for truth, assigned_ids in by_truth.items():
        assert len(assigned_ids) == 1, f"{truth} was split into {assigned_ids}"
    all_ids = [next(iter(ids)) for ids in by_truth.values()]
    assert len(set(all_ids)) == len(all_ids), "two real sessions were merged"
    # The clients that send no ids were grouped by the reply echo, the others by their headers.
    assert sources["llm"] <= {"echo", "new"} and "echo" in sources["llm"]
    assert sources["opencode"] == {"header"} and sources["codex"] == {"header"}


def test_title_requests_land_in_their_session_and_project() -> None:
    records = [r for r in _recorded() if r["agent"] == "opencode" and isinstance(r.get("body"), dict)]
    registry = SessionRegistry()
    projects: dict[str, str] = {}
    for record in records:
        headers = {k.lower(): v for k, v in record["headers"].items()}
        assigned = registry.assign(headers, record["body"])
        project, how = resolve_project(None, None, {}, headers, record["body"], projects.get(assigned.session_id))
        projects.setdefault(assigned.session_id, project)
        if record["truth"]["kind"] == "aux_title":
            assert assigned.source == "header:x-session-id"
        else:
            assert how == "workspace"
    assert len(projects) == 3


def _chat(system: str, *turns: tuple[str, str]) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}]
    for role, text in turns:
        messages.append({"role": role, "content": text})
    return {"model": "m", "messages": messages}


SYSTEM = "You are a coding assistant. Always answer with complete files.\nKeep explanations short and precise."
REPLY_A = (
    "def parse_config(path: str) -> dict[str, str]:\n    with open(path) as handle:\n        return load_pairs(handle)"
)
REPLY_B = "class RateLimiter:\n    def __init__(self, per_second: float) -> None:\n        self.per_second = per_second"


def test_clients_without_ids_are_grouped_by_reply_echo_not_by_shared_prompts() -> None:
    registry = SessionRegistry()
    a1 = registry.assign({}, _chat(SYSTEM, ("user", "write parse_config")))
    registry.note_reply(a1.session_id, REPLY_A, [])
    b1 = registry.assign({}, _chat(SYSTEM, ("user", "write a rate limiter")))
    registry.note_reply(b1.session_id, REPLY_B, [])
    assert a1.session_id != b1.session_id and a1.source == b1.source == "new"
    # Session A continues, rewriting its history (the first user turn is summarised away).
    a2 = registry.assign(
        {}, _chat(SYSTEM, ("user", "(summary of earlier turns)"), ("assistant", REPLY_A), ("user", "add caching"))
    )
    assert (a2.session_id, a2.source) == (a1.session_id, "echo:reply")
    # A side request with a different system prompt quotes the served code in a diff: same session.
    diff = "diff --git a/config.py b/config.py\n" + "\n".join("+" + line for line in REPLY_B.splitlines())
    side = registry.assign({}, _chat("Write a one-line commit message for this diff.", ("user", diff)))
    assert (side.session_id, side.source) == (b1.session_id, "echo:lines")
    # A new conversation that shares only the system prompt and a few-shot example is a new session.
    c1 = registry.assign(
        {}, _chat(SYSTEM, ("user", "example: write hello"), ("assistant", "print('hello')"), ("user", "x"))
    )
    assert c1.source == "new" and c1.session_id not in (a1.session_id, b1.session_id)


def test_a_first_request_given_up_on_and_sent_again_keeps_its_session() -> None:
    """Qwen Code ends a first request after its timeout and sends it again: one conversation, not one per attempt."""
    registry = SessionRegistry()
    first = _chat(SYSTEM, ("user", "Create hello.py that prints hello."))
    gave_up = registry.assign({}, first)
    registry.note_unanswered(gave_up, first)
    again = registry.assign({}, json.loads(json.dumps(first)))  # the same bytes, parsed anew
    assert (again.session_id, again.source) == (gave_up.session_id, "retry")
    # Answered this time: a later identical first request is a new conversation (the user asked again).
    registry.note_reply(again.session_id, REPLY_A, [])
    later = registry.assign({}, first)
    assert later.source == "new" and later.session_id != gave_up.session_id
    # Only a conversation's first request is kept for a retry, and only a body that holds a conversation.
    other = _chat(SYSTEM, ("user", "something else"))
    registry.note_unanswered(again, other)  # its source is "retry", not "new"
    assert registry.assign({}, other).source == "new"
    empty = registry.assign({}, {"model": "m"})
    registry.note_unanswered(empty, {"model": "m"})
    assert registry.assign({}, {"model": "m"}).source == "new"


def test_reply_served_to_two_sessions_groups_neither() -> None:
    registry = SessionRegistry()
    registry.note_reply("s1", "Sure, here is the complete updated file for you.", [])
    registry.note_reply("s2", "Sure, here is the complete updated file for you.", [])
    got = registry.assign({}, _chat(SYSTEM, ("assistant", "Sure, here is the complete updated file for you.")))
    assert got.source == "new"


def test_tool_call_ids_echo() -> None:
    registry = SessionRegistry()
    registry.note_reply("s-tools", "", ["call_42"])
    body = {
        "messages": [{"role": "user", "content": "go"}, {"role": "tool", "tool_call_id": "call_42", "content": "ok"}]
    }
    assert registry.assign({}, body).session_id == "s-tools"
    responses_body = {"input": [{"type": "function_call_output", "call_id": "call_42", "output": "ok"}]}
    assert registry.assign({}, responses_body).source == "echo:tool-call"


@pytest.mark.parametrize(
    ("headers", "body", "expected"),
    [
        ({"x-session-id": "ses_1", "x-session-affinity": "ses_1"}, {}, ("ses_1", "header:x-session-id")),
        ({"session-id": "0199", "thread-id": "0199"}, {}, ("0199", "header:session-id")),
        ({"x-claude-code-session-id": "cc"}, {}, ("cc", "header:x-claude-code-session-id")),
        ({"x-my-agent-session-id": "m"}, {}, ("m", "header:x-my-agent-session-id")),
        ({}, {"prompt_cache_key": "k"}, ("k", "body:prompt_cache_key")),
        ({}, {"client_metadata": {"session_id": "c"}}, ("c", "body:client_metadata.session_id")),
        ({}, {"metadata": {"user_id": "user_abc_account_x_session_77"}}, ("77", "body:metadata.user_id")),
        ({}, {"user": "u1"}, ("u1", "body:user")),
    ],
)
def test_explicit_ids_in_order(headers: dict[str, str], body: dict[str, Any], expected: tuple[str, str]) -> None:
    got = SessionRegistry().assign(headers, body)
    assert (got.session_id, got.source) == expected


def test_subagents_are_grouped_under_their_parent_and_marked() -> None:
    registry = SessionRegistry()
    child = registry.assign({"x-parent-session-id": "parent-1"}, _chat(SYSTEM, ("user", "look up a file")))
    assert (child.session_id, child.parent_id, child.subagent) == ("parent-1", "parent-1", True)
    marked = registry.assign({"x-openai-subagent": "review", "session-id": "p2"}, {})
    assert (marked.session_id, marked.subagent) == ("p2", True)


@pytest.mark.parametrize(
    ("path_project", "api_key", "headers", "body", "session_project", "expected"),
    [
        ("projA", "k", {}, {}, "s", ("projA", "path")),
        (None, "k", {}, {}, "s", ("keyproj", "api-key")),
        (
            None,
            None,
            {"x-codex-turn-metadata": '{"workspaces": {"/home/dev/work/shop": {}}}'},
            {},
            None,
            ("shop", "workspace"),
        ),
        (
            None,
            None,
            {},
            {"messages": [{"role": "system", "content": "x\nWorking directory: /srv/app\n"}]},
            None,
            ("app", "workspace"),
        ),
        (
            None,
            None,
            {},
            {"messages": [{"role": "user", "content": "<cwd>C:\\code\\tool</cwd>"}]},
            None,
            ("tool", "workspace"),
        ),
        (None, None, {}, {}, "from-session", ("from-session", "session")),
        (None, None, {}, {}, None, ("default", "default")),
    ],
)
def test_project_resolution_order(
    path_project: str | None,
    api_key: str | None,
    headers: dict[str, str],
    body: dict[str, Any],
    session_project: str | None,
    expected: tuple[str, str],
) -> None:
    assert resolve_project(path_project, api_key, {"k": "keyproj"}, headers, body, session_project) == expected


def test_a_workspace_path_found_by_the_caller_is_used_as_is() -> None:
    body = {"messages": [{"role": "system", "content": "Working directory: /home/dev/elsewhere"}]}
    assert resolve_project(None, None, {}, {}, body, None, workspace_path="/home/dev/shop") == ("shop", "workspace")
    assert resolve_project(None, None, {}, {}, body, "old", workspace_path=None) == ("old", "session")
    assert resolve_project(None, None, {}, {}, body, None) == ("elsewhere", "workspace")


def test_a_served_tool_call_reads_as_the_model_wrote_it_and_the_same_when_sent_back() -> None:
    """Streamed (chat, Responses, Anthropic) or whole, a call reads `{"name": ..., "arguments": ...}`, as the
    templates render it; sent back with other spacing (opencode's compact JSON) it reads the same, so the
    statistics' stream repeats where the server's does, and the reply is known when it comes back."""
    from adaptive_spec.sessions.messages import context_entries, context_texts, message_digest
    from adaptive_spec.streams.output import OutputCollector, event_output

    args = '{"filePath": "/r/a.py", "limit": 20}'
    want = '{"name": "read", "arguments": {"filePath": "/r/a.py", "limit": 20}}'
    chat: list[dict[str, Any]] = [
        {"choices": [{"delta": {"content": "Reading."}}]},
        {
            "choices": [
                {"delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "read", "arguments": ""}}]}}
            ]
        },
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": args[:9]}}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": args[9:]}}]}}]},
        {
            "choices": [
                {"delta": {"tool_calls": [{"index": 1, "id": "c2", "function": {"name": "read", "arguments": args}}]}}
            ]
        },
    ]
    responses: list[dict[str, Any]] = [
        {"type": "response.output_item.added", "item": {"type": "function_call", "call_id": "c1", "name": "read"}},
        {"type": "response.function_call_arguments.delta", "delta": args},
        {"type": "response.output_text.delta", "delta": "Done."},
    ]
    anthropic: list[dict[str, Any]] = [
        {"type": "content_block_start", "content_block": {"type": "tool_use", "id": "c1", "name": "read"}},
        {"type": "content_block_delta", "delta": {"type": "input_json_delta", "partial_json": args}},
    ]
    read = []
    for events in (chat, responses, anthropic):
        collector = OutputCollector()
        for event in events:
            collector.add(*event_output(event))
        read.append(collector.text)
    assert read == ["Reading.\n" + want + "\n" + want, want + "Done.", want]
    whole, ids = body_output(
        {"choices": [{"message": {"tool_calls": [{"id": "c1", "function": {"name": "read", "arguments": args}}]}}]}
    )
    assert "".join(whole) == want[:-1]  # the collector closes it
    collector = OutputCollector()
    collector.add(whole, ids)
    assert collector.text == want and ids == ["c1"] and collector.calls == 1
    sent_back = {"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"filePath":"/r/a.py","limit":20}'}}
    ]}, {"role": "tool", "tool_call_id": "c1", "content": "1: x = 1"}]}  # fmt: skip
    # As the statistics read it (its arguments spaced); on the request path as sent, which the digests ignore.
    (role, assistant, text, calls), (tool_role, _, result, no_calls) = context_entries(sent_back, spaced={0})
    compact = next(context_texts(sent_back))[2]
    assert compact == '{"name": "read", "arguments": {"filePath":"/r/a.py","limit":20}}'
    assert message_digest("assistant", compact) == message_digest("assistant", text)
    assert (role, assistant, text, calls) == ("assistant", True, want, True)
    assert message_digest("assistant", text) == message_digest("assistant", collector.text)
    assert (tool_role, result, no_calls) == ("tool", "1: x = 1", False)
    # Text and two calls, sent back as they were served: the same text, token for token.
    call = {"function": {"name": "read", "arguments": '{"filePath":"/r/a.py","limit":20}'}}
    both = {"messages": [{"role": "assistant", "content": "Reading.", "tool_calls": [call, call]}]}
    assert next(context_entries(both, spaced={0}))[2] == read[0]
    odd = {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "w", "arguments": "{not json"}}]}]}
    assert next(context_entries(odd, spaced={0}))[2] == '{"name": "w", "arguments": {not json}'  # not JSON: as given


CONTEXT = "<session_context>\nToday's date is Friday, December 4, 2026.\nWorkspace: /home/dev/demo\n</session_context>"
ASK = "Create hello.py that prints hello."


def test_a_side_request_about_the_opening_turn_joins_the_conversation() -> None:
    """Gemini CLI's router classifier is sent the user's first turn (as two messages) under a system prompt of its
    own, before the conversation itself (one message of two parts): neither names a session."""
    clock = [100.0]
    registry = SessionRegistry(clock=lambda: clock[0])
    classifier = _chat("You are a task router. Answer with JSON.", ("user", CONTEXT), ("user", ASK))
    first = registry.assign({}, classifier)
    registry.note_reply(first.session_id, '{"complexity_score": 20}', [])
    clock[0] += 5
    main = {
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": [{"type": "text", "text": CONTEXT}, {"type": "text", "text": ASK}]},
        ],
        "tools": [{"type": "function", "function": {"name": "write_file", "parameters": {"type": "object"}}}],
    }
    joined = registry.assign({}, main)
    assert (first.source, joined.source) == ("new", "opening") and joined.session_id == first.session_id
    # Given up on before its answer (its client's 300 s), sent again: the same conversation.
    registry.note_unanswered(joined, main)
    again = registry.assign({}, json.loads(json.dumps(main)))
    assert (again.source, again.session_id) == ("retry", first.session_id)


def test_an_opening_asked_again_or_long_after_is_a_conversation_of_its_own() -> None:
    clock = [0.0]
    registry = SessionRegistry(clock=lambda: clock[0])
    opening = _chat(SYSTEM, ("user", CONTEXT), ("user", ASK))
    first = registry.assign({}, opening)
    again = registry.assign({}, opening)  # the same system prompt: the user asking again
    assert again.source == "new" and again.session_id != first.session_id
    clock[0] += 301
    late = registry.assign({}, _chat("You are a task router.", ("user", CONTEXT), ("user", ASK)))
    assert late.source == "new"
    # A short opening ("hi") says nothing about which conversation it is; a request with a reply in it is no opening.
    hi = registry.assign({}, _chat(SYSTEM, ("user", "hi")))
    assert registry.assign({}, _chat("Another system prompt.", ("user", "hi"))).session_id != hi.session_id
    served = _chat("Another.", ("user", CONTEXT), ("assistant", "ok"), ("user", ASK))
    assert registry.assign({}, served).source == "new"


def test_two_agents_given_the_same_first_prompt_are_two_conversations() -> None:
    """Continue CLI and then Cline, each asked "Create hello.py that prints hello." a minute apart, under their own
    system prompts: measured through serve, Cline's first request joined Continue's session before the User-Agent
    was part of the opening."""
    registry = SessionRegistry(clock=lambda: 0.0)
    continue_cli = registry.assign({"user-agent": "ls/JS 5.23.2"}, _chat("You are Continue.", ("user", ASK)))
    cline_ua = {"user-agent": "ai-sdk/openai-compatible/3.0.37 ai-sdk/provider-utils/5.0.30 runtime/bun/1.3.13"}
    cline = registry.assign(cline_ua, _chat("You are Cline.", ("user", ASK)))
    assert cline.source == "new" and cline.session_id != continue_cli.session_id
    # The same client's side request about that opening still joins it.
    side = registry.assign(cline_ua, _chat("Write a title.", ("user", ASK)))
    assert (side.source, side.session_id) == ("opening", cline.session_id)
