"""Agents named from their User-Agent (and, where that is a library's, its headers), as they sent them."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from adaptive_spec.sessions.agents.clients import client_name


@pytest.mark.parametrize(
    ("user_agent", "headers", "name"),
    [
        ("opencode/1.18.33 ai-sdk/provider-utils/4.0.23 runtime/bun/1.3.14", {}, "opencode"),
        ("GeminiCLI-tui/0.61.0/gemini-3.1-pro-preview (linux; x64; terminal)", {}, "gemini-cli"),
        ("GeminiCLI/0.61.0/gemini-3.1-pro-preview (linux; x64)", {}, "gemini-cli"),
        ("ls/JS 5.23.2", {}, "continue-cli"),
        ("ai-sdk/openai-compatible/3.0.37 ai-sdk/provider-utils/5.0.30 runtime/bun/1.3.13", {}, "cline"),
        ("OpenAI/JS 6.26.0", {"session_id": "01a23ec6", "x-session-affinity": "01a23ec6"}, "pi"),
        ("OpenAI/JS 6.26.0", {}, "openai-js"),
        ("OpenAI/Python 3.57.0", {"session_id": "x"}, "openai-python"),
        # A library's line that only looks alike stays the library's.
        ("ai-sdk/openai-compatible/3.0.37 ai-sdk/provider-utils/5.0.30 runtime/node/22", {}, "ai-sdk"),
        ("tools/JS 1.0", {}, "tools"),
        (None, {}, None),
    ],
)
def test_agents_are_named(user_agent: str | None, headers: dict[str, str], name: str | None) -> None:
    assert client_name(user_agent, CIMultiDict(headers)) == name
