"""The new-prompt-token estimate from what a session's slot holds (routing/prompt/prefix.py)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from adaptive_spec.routing.prompt import prefix
from adaptive_spec.routing.prompt.pieces import BLOCK_CHARS, TOOL_CALL_TOKENS, TOOL_RESULT_TOKENS, prompt_pieces
from adaptive_spec.sessions.messages import message_entry
from adaptive_spec.telemetry.records import Timings

SYSTEM = {"role": "system", "content": "You are a coding assistant. " * 40}
TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]


def body(*messages: dict[str, Any], tools: bool = False, system: dict[str, Any] = SYSTEM) -> dict[str, Any]:
    out: dict[str, Any] = {"messages": [system, *messages]}
    if tools:
        out["tools"] = TOOLS
    return out


def served(
    state: prefix.PrefixState | None, request: dict[str, Any], reply: str, prompt_n: int, cache_n: int, out: int
) -> prefix.PrefixState:
    pieces = prompt_pieces(request)
    timings = Timings(prompt_n=prompt_n, cache_n=cache_n, predicted_n=out)
    return prefix.observe(state, pieces, bool(request.get("tools")), reply, timings)


def estimate(state: prefix.PrefixState | None, request: dict[str, Any]) -> prefix.PromptEstimate:
    return prefix.estimate(state, prompt_pieces(request), bool(request.get("tools")), 3.5)


def test_a_first_turn_is_all_new() -> None:
    first = body({"role": "user", "content": "x" * 350})
    est = estimate(None, first)
    assert est.shared_tokens == 0 and est.new_tokens == est.total_tokens
    assert 100 < est.new_tokens < 600


def test_an_appended_turn_costs_only_what_follows_the_echoed_reply() -> None:
    user1 = {"role": "user", "content": "Fix the bug in main.py"}
    state = served(None, body(user1), "Here is the fix: " + "y" * 400, prompt_n=300, cache_n=0, out=120)
    reply = {"role": "assistant", "content": "Here is the fix: " + "y" * 400}
    user2 = {"role": "user", "content": "z" * 70}
    est = estimate(state, body(user1, reply, user2))
    # The slot holds the 300-token prompt and the 120-token reply; the new part is ~20 tokens of text plus markers.
    assert est.shared_tokens == 300 - 1 + 120
    assert 15 <= est.new_tokens <= 40


def test_a_call_the_model_spaced_otherwise_is_reused_only_up_to_where_it_differs() -> None:
    """Claude Code on the 0.5B: the model wrote a call on several lines (its arguments indented under the call's
    own keys); llama-server renders the call sent back on one, so the slot's copy of the reply is reused up to the
    call (3 of 431 tokens there) and the rest is prefilled again."""
    from adaptive_spec.streams.output import CallArguments, OutputCollector, call_head

    arguments = '{\n    "description": "' + "d" * 2000 + '"\n}'
    out = OutputCollector()
    out.add([call_head("Agent"), CallArguments(arguments)], ["c1"])
    kept = out.kept_share()
    assert kept == 0.0
    after = OutputCollector()  # text after a call that differed is not reached either
    after.add([call_head("Agent"), CallArguments(arguments), "Done."], ["c1"])
    assert after.kept_share() == 0.0
    one_line = OutputCollector()  # a call on one line whose arguments differ inside: kept up to there
    one_line.add(["Here.", call_head("Write"), CallArguments('{"path":"a.py", "content": "x"}')], ["c3"])
    assert one_line.kept_share() == pytest.approx(
        (len("Here.\n") + len(call_head("Write")) + len('{"path":')) / len(one_line.text)
    )
    user1 = {"role": "user", "content": "Create hello.py"}
    timings = Timings(prompt_n=300, cache_n=0, predicted_n=700)
    state = prefix.observe(None, prompt_pieces(body(user1, tools=True)), True, out.text, timings, reply_kept=kept)
    assert state.reply_tokens + state.reply_again == 700 and state.reply_again > 680
    call = {"id": "c1", "type": "function", "function": {"name": "Agent", "arguments": arguments}}
    history: list[dict[str, Any]] = [user1, {"role": "assistant", "content": "", "tool_calls": [call]}]
    est = estimate(state, body(*history, {"role": "tool", "tool_call_id": "c1", "content": "ok"}, tools=True))
    assert est.new_tokens > 680  # the reply again, then the result
    # Written as the template writes it, the whole reply stays.
    spaced = OutputCollector()
    spaced.add([call_head("Agent"), CallArguments('{"description": "' + "d" * 2000 + '"}')], ["c1"])
    assert spaced.kept_share() == 1.0
    # Text before the call is kept; arguments that are not JSON are rendered as given.
    broken = OutputCollector()
    broken.add(["Writing it now.", call_head("Write"), CallArguments("{not json")], ["c2"])
    assert broken.kept_share() == 1.0
    assert OutputCollector().kept_share() == 1.0


def test_a_reply_the_client_rewrote_is_prefilled_again() -> None:
    user1 = {"role": "user", "content": "Fix the bug"}
    state = served(None, body(user1), "the served answer " * 20, prompt_n=300, cache_n=0, out=80)
    edited = {"role": "assistant", "content": "another text " * 20}
    est = estimate(state, body(user1, edited, {"role": "user", "content": "next"}))
    assert est.shared_tokens == 299 and est.new_tokens > 60


def test_a_rewritten_history_shares_only_its_unchanged_head() -> None:
    a, b = {"role": "user", "content": "a" * 700}, {"role": "user", "content": "b" * 700}
    state = served(None, body(a, b), "ok", prompt_n=500, cache_n=0, out=2)
    est = estimate(state, body(a, {"role": "user", "content": "c" * 700}))
    assert 0 < est.shared_tokens < est.total_tokens and est.new_tokens >= 100
    # the chars per token came from llama-server's count: 500 tokens for the prompt's characters and markers
    assert state.chars_per_token > 2


def test_a_title_request_with_another_system_prompt_is_a_side_request() -> None:
    main = body({"role": "user", "content": "go"}, tools=True)
    state = served(None, main, "done", prompt_n=900, cache_n=0, out=10)
    title = body({"role": "user", "content": "go"}, system={"role": "system", "content": "Write a title."})
    assert estimate(state, title).side
    assert not estimate(
        state, body({"role": "user", "content": "go"}, {"role": "user", "content": "more"}, tools=True)
    ).side


def test_a_main_line_with_tools_after_a_title_request_moves_the_line() -> None:
    title = body({"role": "user", "content": "go"}, system={"role": "system", "content": "Write a title."})
    state = served(None, title, "A title", prompt_n=60, cache_n=0, out=3)
    est = estimate(state, body({"role": "user", "content": "go"}, tools=True))
    assert est.line_moved and not est.side
    after = served(state, body({"role": "user", "content": "go"}, tools=True), "ok", 900, 3, 2)
    assert estimate(after, title).side


def test_a_new_session_reuses_the_system_prompt_another_session_left_in_the_slot() -> None:
    other = served(None, body({"role": "user", "content": "first task"}, tools=True), "done", 2000, 0, 5)
    fresh = body({"role": "user", "content": "another task"}, tools=True)
    alone = estimate(None, fresh)
    est = prefix.estimate(None, prompt_pieces(fresh), True, 3.5, slot=other)
    # tools and system prompt are held: only the user message and the template around it are new
    assert est.shared_tokens > 0 and est.new_tokens < 30 < alone.new_tokens
    assert prefix.shared_tokens(other, prompt_pieces(fresh), 3.5) == est.shared_tokens


def test_the_template_cost_of_tool_turns_is_learned_from_llama_servers_counts() -> None:
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "read", "arguments": '{"path": "a.py"}'}}],
    }
    result = {"role": "tool", "tool_call_id": "c1", "content": "print(1)\n" * 5}
    first = body({"role": "user", "content": "go"}, tools=True)
    state = served(None, first, "text", 1000, 0, 16)
    second = body({"role": "user", "content": "go"}, call, result, tools=True)
    raw = estimate(state, second).new_tokens
    after = served(state, second, "text", prompt_n=raw * 2, cache_n=999, out=16)  # the server prefilled twice as many
    assert after.new_ratio > 1.4
    third = body({"role": "user", "content": "go"}, call, result, call, result, tools=True)
    assert (
        estimate(after, third).new_tokens
        > 1.4 * estimate(state, body({"role": "user", "content": "go"}, call, result, tools=True)).new_tokens
    )


def test_a_piece_that_changes_only_near_its_end_still_shares_its_head() -> None:
    # A tool list whose last description differs (an agent's new session id): the server reuses all but its tail.
    tools_a = [{"type": "function", "function": {"name": f"t{i}", "description": "d" * 300}} for i in range(20)]
    tools_b = [*tools_a[:-1], {"type": "function", "function": {"name": "t19", "description": "e" * 300}}]
    user = {"role": "user", "content": "Fix the bug"}
    first = {"messages": [SYSTEM, user], "tools": tools_a}
    state = served(None, first, "ok", prompt_n=2500, cache_n=0, out=2)
    est = prefix.estimate(None, prompt_pieces({"messages": [SYSTEM, user], "tools": tools_b}), True, 3.5, state)
    changed_chars = 300 + 2 * BLOCK_CHARS  # the changed description and at most the blocks it straddles
    assert 0 < est.new_tokens <= changed_chars / 3.5 + 20
    # Without the blocks (a different first character), the whole list and what follows are new.
    tools_c = [{"type": "function", "function": {"name": "u0", "description": "d" * 300}}, *tools_a[1:]]
    whole = prefix.estimate(None, prompt_pieces({"messages": [SYSTEM, user], "tools": tools_c}), True, 3.5, state)
    assert whole.new_tokens > 20 * 300 / 3.5


def test_block_digests_depend_on_everything_before_them() -> None:
    a = prompt_pieces({"prompt": "x" * 300 + "y" * 600})[0]
    b = prompt_pieces({"prompt": "z" + "x" * 299 + "y" * 600})[0]
    assert len(a.blocks) == len(b.blocks) == 3 * 8  # 900 chars: three whole 256-char blocks
    # Only the first block differs in its text, yet every chained digest after it differs too.
    assert all(a.blocks[i : i + 8] != b.blocks[i : i + 8] for i in range(0, 24, 8))


def test_tool_calls_and_results_cost_their_template_tokens_in_every_api_shape() -> None:
    chat = {
        "messages": [
            {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}] * 2},
            {"role": "tool", "content": "x"},
        ]
    }
    responses = {
        "input": [{"type": "function_call", "arguments": "{}"}, {"type": "function_call_output", "output": "x"}]
    }
    anthropic = {
        "messages": [
            {"role": "assistant", "content": [{"type": "tool_use", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "content": "x"}]},
        ]
    }
    assert [p.extra for p in prompt_pieces(chat)] == [2 * TOOL_CALL_TOKENS, TOOL_RESULT_TOKENS]
    assert [p.extra for p in prompt_pieces(responses)] == [TOOL_CALL_TOKENS, TOOL_RESULT_TOKENS]
    assert [p.extra for p in prompt_pieces(anthropic)] == [TOOL_CALL_TOKENS, TOOL_RESULT_TOKENS]
    plain = prompt_pieces({"instructions": "be brief", "input": [{"role": "user", "content": "hi"}]})
    assert [p.extra for p in plain] == [0.0, 0.0]


def test_tools_the_server_does_not_render_are_not_counted() -> None:
    function = {"type": "function", "name": "run", "parameters": {"type": "object"}}
    both = {"input": "hi", "tools": [function, {"type": "namespace", "tools": ["y" * 5000]}, {"type": "web_search"}]}
    tools = next(p for p in prompt_pieces(both) if p.tools)
    assert tools.chars == len(orjson.dumps([function]))
    assert not any(p.tools for p in prompt_pieces({"input": "hi", "tools": [{"type": "web_search"}]}))


def test_a_tiny_prompt_barely_moves_the_characters_per_token_rate() -> None:
    # 21 characters under a template's default system prompt: 35 tokens. Taken at face value that is < 1 char/token.
    tiny = served(None, {"messages": [{"role": "user", "content": "x" * 21}]}, "ok", prompt_n=35, cache_n=0, out=2)
    assert 3.0 < tiny.chars_per_token <= 3.5
    # A large prompt counts in full.
    big = served(None, {"messages": [{"role": "user", "content": "x" * 8000}]}, "ok", prompt_n=2009, cache_n=0, out=2)
    assert big.chars_per_token == pytest.approx(4.0, rel=0.01)


def _turns() -> list[dict[str, Any]]:
    """A session's requests: it grows, a tool call and its result come back, an old message is edited, the tools
    change, a message is dropped, and it shrinks to one turn."""
    call = {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "read", "arguments": '{"p":1}'}}]}
    result = {"role": "tool", "content": "def f():\n    return 1\n" * 30}
    u1, u2 = {"role": "user", "content": "read it"}, {"role": "user", "content": "now change it"}
    edited = {"role": "user", "content": "READ IT"}  # the same length: only the text tells
    other_tools = {"tools": [{"type": "function", "function": {"name": "write"}}]}
    return [
        body(u1, tools=True),
        body(u1, call, result, tools=True),
        body(u1, call, result, {"role": "assistant", "content": "done"}, u2, tools=True),
        body(edited, call, result, {"role": "assistant", "content": "done"}, u2, tools=True),
        {**body(edited, call, result, u2), **other_tools},
        body(edited, call, u2),
        body(u2),
        {"instructions": "be brief", "input": [u1, {"type": "function_call", "name": "read", "arguments": "{}"}]},
    ]


# A session served before: its requests are kept to compare the next one with.
SERVED = prefix.observe(None, (), False, "", Timings(prompt_n=10))


def test_a_session_s_pieces_equal_those_read_afresh_whatever_changed() -> None:
    table = prefix.PrefixTable()
    for request in _turns():
        # Parsed anew each time, as each request is: equal messages, other objects.
        copy = orjson.loads(orjson.dumps(request))
        assert table.pieces(copy, SERVED, "s", 1000) == prompt_pieces(request)


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The messages `prompt_pieces` reads from here on (their texts)."""
    read: list[str] = []

    def counted(message: dict[str, Any], spaced: bool = False) -> tuple[str, bool, str, bool]:
        read.append(str(message.get("content")))
        return message_entry(message, spaced)

    monkeypatch.setattr("adaptive_spec.routing.prompt.pieces.message_entry", counted)
    return read


def test_a_session_s_next_request_reads_only_its_new_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    table = prefix.PrefixTable()
    read = _count_reads(monkeypatch)
    first, _, third = _turns()[:3]
    table.pieces(orjson.loads(orjson.dumps(first)), SERVED, "s", 1000)
    assert len(read) == 2  # the system prompt and the user's message
    read.clear()
    table.pieces(orjson.loads(orjson.dumps(third)), SERVED, "s", 1000)
    assert len(read) == 4  # the call, its result, the reply and the new question: not the two it carried before
    read.clear()
    table.pieces(orjson.loads(orjson.dumps(third)), SERVED, "other", 1000)
    assert len(read) == 6  # another session has nothing of its own to compare with
    read.clear()
    table.pieces(orjson.loads(orjson.dumps(first)), None, "new", 1000)
    table.pieces(orjson.loads(orjson.dumps(first)), SERVED, "new", 1000)
    assert len(read) == 4  # a session not served yet keeps nothing: its next request reads every message


def test_the_requests_kept_for_comparison_are_bounded_by_their_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    table = prefix.PrefixTable(max_seen_bytes=2500)
    requests = [body({"role": "user", "content": str(i)}) for i in range(4)]
    for i, request in enumerate(requests):
        table.pieces(request, SERVED, f"s{i}", 1000)
    read = _count_reads(monkeypatch)
    for i, request in reversed(list(enumerate(requests))):  # the newest first: each read puts its session back
        read.clear()
        table.pieces(request, SERVED, f"s{i}", 1000)
        # Two requests of 1,000 bytes fit in 2,500: the older sessions' were dropped and are read again.
        assert len(read) == (2 if i < 2 else 0), i


def test_the_tools_piece_counts_the_spaces_a_templates_tojson_adds() -> None:
    """Templates render each tool with `tojson` (`", "` and `": "`): about a token a space, on top of the compact JSON
    whose characters are counted (Cline's 25 tools: 803 tokens, its first turn 15% low without them)."""
    import json

    import orjson

    from adaptive_spec.routing.prompt.pieces import prompt_pieces

    tools = [
        {"type": "function", "function": {"name": "read", "parameters": {"type": "object", "properties": {}}}},
        {"type": "function", "function": {"name": "w", "parameters": {"type": "object", "required": ["a", "b"]}}},
    ]
    (piece,) = [p for p in prompt_pieces({"messages": [{"role": "user", "content": "x"}], "tools": tools}) if p.tools]
    assert piece.extra == sum(len(json.dumps(t)) - len(orjson.dumps(t)) for t in tools)


def test_the_main_line_goes_on_under_a_new_system_prompt_with_the_same_tools() -> None:
    """Continue CLI writes the workspace into its system prompt each run: its --resume turn has a new system prompt,
    the same tools and the history. That is the line going on, not a side request; a title request still is one."""
    ask = {"role": "user", "content": "Create hello.py"}
    state = served(None, body(ask, tools=True), "done", prompt_n=900, cache_n=0, out=10)
    resumed_system = {"role": "system", "content": "You are a coding assistant. Files: hello.py. " * 40}
    resumed = body(ask, {"role": "assistant", "content": "done"}, {"role": "user", "content": "now bye"}, tools=True)
    resumed["messages"][0] = resumed_system
    est = estimate(state, resumed)
    assert not est.side and not est.line_moved
    after = served(state, resumed, "ok", prompt_n=300, cache_n=700, out=2)
    assert not estimate(after, resumed).side
    title = body(ask, system={"role": "system", "content": "Write a title."})
    assert estimate(after, title).side


def test_the_templates_own_system_block_counts_for_a_prompt_without_one() -> None:
    # Qwen's template writes its default system prompt ahead of a bare question: 21 tokens, on llama-server.
    bare = {"messages": [{"role": "user", "content": "Write a python function that adds two numbers."}]}
    pieces = prompt_pieces(bare)
    plain = prefix.estimate(None, pieces, False, 3.5)
    opened = prefix.estimate(None, pieces, False, 3.5, opening=21.0)
    assert opened.total_tokens == opened.new_tokens == plain.new_tokens + 21
    # A second bare session with the same question: the slot holds the block too, so it is shared, not new.
    other = prefix.observe(None, pieces, False, "ok", Timings(prompt_n=38, cache_n=0, predicted_n=2), opening=21.0)
    again = prefix.estimate(None, pieces, False, 3.5, slot=other, opening=21.0)
    assert again.shared_tokens == 38 - 1 + 0 and again.new_tokens < 10
    # Against a slot whose prompt shares the first message only: the block ahead of it is held with it.
    a, b, c = ({"role": "user", "content": text * 20} for text in "abc")
    held = prefix.observe(None, prompt_pieces({"messages": [a, b]}), False, "ok", Timings(90, 0, 2), opening=21.0)
    shared = prefix.shared_tokens(held, prompt_pieces({"messages": [a, c]}), 3.5, opening=21.0)
    assert shared == round(21.0 + 20 / 3.5 + prefix.PIECE_OVERHEAD_TOKENS)
    # Another bare prompt, no message in common: the slot still opens with the same block.
    d = {"role": "user", "content": "d" * 20}
    assert prefix.shared_tokens(held, prompt_pieces({"messages": [d]}), 3.5, opening=21.0) == 21
    system = prefix.observe(None, prompt_pieces(body(b)), False, "ok", Timings(300, 0, 2))
    assert prefix.shared_tokens(system, prompt_pieces({"messages": [d]}), 3.5, opening=21.0) == 0


def test_the_templates_opening_is_not_taken_for_the_texts_rate() -> None:
    bare = {"messages": [{"role": "user", "content": "x" * 3000}]}
    pieces = prompt_pieces(bare)
    timings = Timings(prompt_n=round(3000 / 4 + 9 + 21), cache_n=0, predicted_n=1)
    state = prefix.observe(None, pieces, False, "ok", timings, opening=21.0)
    assert state.chars_per_token == pytest.approx(4.0, rel=0.01)
    assert prefix.observe(None, pieces, False, "ok", timings).chars_per_token < 3.9  # the block read as text


# A prompt the slot holds whole: llama-server's n_past is the prompt's length, which it lowers by one ("need to
# evaluate at least 1 token"), so it prefills exactly 1 token (prompt_n 1 seen for Gemini CLI on the 0.5B), whatever
# the session's learned ratio; and the repeat teaches that ratio nothing.
USER = {"role": "user", "content": "Fix the bug in main.py. " * 10}
REPLY = {"role": "assistant", "content": "Here is the fix: " + "y" * 400}
HELD_WHOLE = [
    ("the same prompt again", body(USER), body(USER)),
    ("the same tool prompt again", body(USER, tools=True), body(USER, tools=True)),
    ("a conversation with history again", body(USER, REPLY, {"role": "user", "content": "go on"}), None),
]


@pytest.mark.parametrize(("case", "first", "again"), HELD_WHOLE, ids=[c[0] for c in HELD_WHOLE])
def test_a_prompt_the_slot_holds_whole_prefills_one_token(
    case: str, first: dict[str, Any], again: dict[str, Any] | None
) -> None:
    state = served(None, first, REPLY["content"], prompt_n=300, cache_n=0, out=120)
    state = prefix.PrefixState(**{**{f: getattr(state, f) for f in state.__slots__}, "new_ratio": 2.5})
    est = estimate(state, again if again is not None else first)
    assert est.new_tokens == 1 and est.shared_tokens == 299, case
    learned = served(state, again if again is not None else first, REPLY["content"], prompt_n=1, cache_n=299, out=120)
    assert learned.new_ratio == 2.5, case


# What a follow-up teaches the session's ratio of prefilled to estimated new tokens: only a turn whose cache_n is the
# prefix its state says is held (Claude Code's turn after its compaction request: its state was the compaction's,
# llama-server restored the conversation from its RAM cache, 1,051 cached: the sample 374/1,624 pulled the next
# turns' estimates 20-40% low).
NEXT = body(USER, REPLY, {"role": "user", "content": "z" * 700})
RATIO_CASES = [("cached as held", 419, True), ("more cached than held", 1500, False), ("little cached", 30, False)]


@pytest.mark.parametrize(("case", "cache_n", "learns"), RATIO_CASES, ids=[c[0] for c in RATIO_CASES])
def test_the_ratio_learns_only_from_turns_that_reused_what_the_state_says_is_held(
    case: str, cache_n: int, learns: bool
) -> None:
    state = served(None, body(USER), REPLY["content"], prompt_n=300, cache_n=0, out=120)
    learned = served(state, NEXT, "ok", prompt_n=600, cache_n=cache_n, out=4)
    assert (learned.new_ratio != state.new_ratio) == learns, (case, learned.new_ratio)
