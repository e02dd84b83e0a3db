"""Which agent sent a request, from its User-Agent: a short name for people to read (never used to group)."""

from __future__ import annotations

import re
from collections.abc import Mapping

_KNOWN = (
    ("opencode", "opencode"),
    ("codex", "codex"),
    ("claude-cli", "claude-code"),
    ("claude-code", "claude-code"),
    ("qwencode", "qwen-code"),
    ("geminicli", "gemini-cli"),
    ("aider", "aider"),
    ("litellm", "litellm"),
    ("continue", "continue"),
    ("llm/", "llm"),
    ("openai/python", "openai-python"),
    ("openai/js", "openai-js"),
    ("curl/", "curl"),
)
# Agents whose User-Agent is a library's, told apart by its whole shape (as they sent it, measured):
# Continue CLI 1.5.47 bundles the openai SDK 5, whose class name the bundler shortened (`ls/JS 5.23.2`); Cline CLI
# 3.0.65 sends the AI SDK's own line with no product of its own, on bun (`ai-sdk/openai-compatible/3.0.37
# ai-sdk/provider-utils/5.0.30 runtime/bun/1.3.13`; opencode's starts with `opencode/`).
_SHAPES = (
    (re.compile(r"ls/JS \d"), "continue-cli"),
    (re.compile(r"ai-sdk/openai-compatible/\S+ .*runtime/bun/"), "cline"),
)
_PRODUCT = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,23}")


def client_name(user_agent: str | None, headers: Mapping[str, str] | None = None) -> str | None:
    """A known agent's name, else the User-Agent's first product token (at most 24 characters), else None.
    `headers`: the request's (case-insensitive), for an agent that only its headers tell apart: pi 0.73 is the openai
    SDK's `OpenAI/JS`, with a `session_id` header when its provider's `compat.sendSessionAffinityHeaders` is on."""
    if not user_agent:
        return None
    for shape, name in _SHAPES:
        if shape.match(user_agent):
            return name
    lowered = user_agent.lower()
    for needle, name in _KNOWN:
        if needle in lowered:
            if name == "openai-js" and headers is not None and headers.get("session_id"):
                return "pi"
            return name
    match = _PRODUCT.match(user_agent.strip())
    return match.group(0).lower() if match else None
