"""Which agent sent a request, from its User-Agent: a short name for people to read (never used to group)."""

from __future__ import annotations

import re

_KNOWN = (
    ("opencode", "opencode"),
    ("codex", "codex"),
    ("claude-cli", "claude-code"),
    ("claude-code", "claude-code"),
    ("qwencode", "qwen-code"),
    ("aider", "aider"),
    ("litellm", "litellm"),
    ("continue", "continue"),
    ("llm/", "llm"),
    ("openai/python", "openai-python"),
    ("openai/js", "openai-js"),
    ("curl/", "curl"),
)
_PRODUCT = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,23}")


def client_name(user_agent: str | None) -> str | None:
    """A known agent's name, else the User-Agent's first product token (at most 24 characters), else None."""
    if not user_agent:
        return None
    lowered = user_agent.lower()
    for needle, name in _KNOWN:
        if needle in lowered:
            return name
    match = _PRODUCT.match(user_agent.strip())
    return match.group(0).lower() if match else None
