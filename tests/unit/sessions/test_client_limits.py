"""The agents' waits the keep-alives cannot reset: said at start, and named in a request's record near them."""

from __future__ import annotations

from adaptive_spec.sessions.agents.client_limits import LIMITS, start_line, wait_note


def test_the_start_line_names_every_agent_its_limit_and_what_to_set() -> None:
    line = start_line()
    for limit in LIMITS:
        assert limit.agent in line and limit.setting in line and f"{limit.limit_s:.0f} s" in line


def test_a_wait_near_the_limit_is_named_with_the_setting() -> None:
    assert wait_note("claude-code", 190_000.0) == (
        "waited 190 s; Claude Code gives up after 300 s (its stream watchdog counts the SDK's events, and the SDK "
        "drops `ping`): raise CLAUDE_STREAM_IDLE_TIMEOUT_MS"
    )
    assert "QWEN_STREAM_MAX_LIFETIME_MS" in (wait_note("qwen-code", 450_000.0) or "")


def test_a_short_wait_or_an_agent_without_such_a_limit_gets_no_note() -> None:
    assert wait_note("claude-code", 149_000.0) is None
    assert wait_note("qwen-code", 300_000.0) is None  # its 240 s stream guard the keep-alives do reset
    assert wait_note("pi", 10_000_000.0) is None
    assert wait_note(None, 10_000_000.0) is None
    assert wait_note("claude-code", None) is None
