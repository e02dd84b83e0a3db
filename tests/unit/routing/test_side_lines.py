"""A session's side lines (another system prompt: Claude Code's subagents) estimated against what the server holds of
them: its RAM cache keeps their last prompts as it keeps the main line's, so a side request sent again prefills
almost nothing, and a subagent's next turn only what follows its last one (measured: Claude Code 2.1.332 on the
0.5B, whose subagents' openings came back with prompt_n 1 and were estimated at 8-10k tokens)."""

from __future__ import annotations

from typing import Any

from adaptive_spec.llama.upstreams import Upstream, UpstreamTable
from adaptive_spec.routing.router import Router
from adaptive_spec.telemetry.records import Timings
from tests.support.routing import make_router, request, served


def _tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}


MAIN_TOOLS = [_tool("read"), _tool("write"), _tool("agent")]
SUB_TOOLS = [_tool("read")]  # a subagent has fewer tools than its main line


def _router() -> Router:
    table = UpstreamTable([Upstream("oneshot", "http://127.0.0.1:9")])
    return make_router(table, {"oneshot": 1}, {"oneshot": ("none",)})


def _body(system: str, *turns: str) -> dict[str, Any]:
    roles = ("user", "assistant")
    messages = [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)]
    tools = MAIN_TOOLS if system == MAIN else SUB_TOOLS
    return {"messages": [{"role": "system", "content": system}, *messages], "tools": tools}


def _new_tokens(r: Router, body: dict[str, Any]) -> int:
    decision = r.choose(request(body, "s", pinned="oneshot"))[0]
    assert decision.side and decision.new_tokens is not None, decision
    return decision.new_tokens


MAIN = "You are the main agent. " * 400  # 9,600 characters
SUB_A = "You explore the code base for the user. " * 300  # 12,000
SUB_B = "You plan the change for the user. " * 300  # 10,200


def _session_with_two_subagents() -> Router:
    r = _router()
    served(r, request(_body(MAIN, "fix it"), "s", pinned="oneshot"), Timings(prompt_n=2400, predicted_n=10))
    # The subagents' text tokenizes denser than the main line's (4.0 against 3.3 characters a token here, as a
    # subagent's prompt of code paths and tool names against prose): its own counts are llama-server's.
    served(r, request(_body(SUB_A, "find the file"), "s", pinned="oneshot"), Timings(prompt_n=3100, predicted_n=10))
    served(r, request(_body(SUB_B, "plan it"), "s", pinned="oneshot"), Timings(prompt_n=2700, predicted_n=10))
    return r


def test_a_side_request_sent_again_is_estimated_as_what_the_ram_cache_leaves() -> None:
    r = _session_with_two_subagents()
    assert _new_tokens(r, _body(SUB_A, "find the file")) < 20  # llama-server: prompt_n 1


def test_a_subagents_next_turn_is_its_new_messages_on_the_scale_of_what_the_server_holds() -> None:
    r = _session_with_two_subagents()
    served(r, request(_body(SUB_A, "find the file"), "s", pinned="oneshot"), Timings(prompt_n=1, cache_n=3099))
    reply = "I will read the main module first."
    result = "def main():\n    return 1\n" * 40  # 1,000 characters
    new = _new_tokens(r, _body(SUB_A, "find the file", reply, result))
    assert 200 <= new <= 450, new  # ~300 at either rate; the whole prompt's estimate less the held count is not


def test_the_main_lines_turn_after_a_request_with_its_tools_under_another_system_prompt_counts_what_is_held() -> None:
    """Claude Code's compaction request: another system prompt, the main line's tools, so it is the line going on
    (its state replaces the line's); llama-server's RAM cache keeps the conversation's prompt it displaced, and the
    conversation's next turn prefills only its new messages (Claude Code's shapes on the 0.5B: 1,624 estimated for
    374 prefilled on 1,051 cached)."""
    r = _router()
    history = ("fix it", "I read main.py.", "def main():\n    return 1\n" * 20)
    served(r, request(_body(MAIN, *history), "s", pinned="oneshot"), Timings(prompt_n=2900, predicted_n=10))
    compaction = {**_body(SUB_B, *history, "Summarize the conversation."), "tools": MAIN_TOOLS}
    served(r, request(compaction, "s", pinned="oneshot"), Timings(prompt_n=2800, cache_n=3, predicted_n=10))
    decision = r.choose(request(_body(MAIN, *history, "Now make it print bye.", "done"), "s", pinned="oneshot"))[0]
    assert not decision.side and decision.new_tokens is not None and decision.new_tokens < 100, decision
