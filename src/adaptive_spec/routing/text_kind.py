"""What kind of text a request's answer will be, for the drafter's acceptance before a session has measured its own:
code being edited, code written fresh, or prose and chat. A model drafter guesses code far better than prose
(llama.cpp #23052: prose at 0.68-0.91× with a drafter), so a first turn of prose starts from a lower prior.

Pure and cheap: it reads the request's tools and its last user message (at most `_SCAN_CHARS` of it), never the
history. The session's own measured acceptance replaces the prior after its first drafted answer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

TextKind = Literal["edit", "code", "prose"]
_SCAN_CHARS = 4000
# Words a request for code uses, and marks that code itself leaves in a message.
_CODE_WORDS = re.compile(
    r"\b(?:code|coding|function|method|bug|debug|compiler?|python|javascript|typescript|rust|golang|java|c\+\+|sql|"
    r"regex|regular expression|script|bash|shell|git|linux|docker|terminal|command line|one-liner|implement|"
    r"refactor|unit tests?|variable|struct|enum|json|yaml|html|css|api|endpoint|stack trace|exception|lambda|async|"
    r"thread|race condition|deadlock|database|query|algorithm|program|programming|repository|repo|commit|diff)\b",
    re.IGNORECASE,
)
_CODE_MARKS = re.compile(
    r"```|`[^`\n]+`|[{};]\s*$|^\s*(?:def|class|import|from|fn|func|const|let|var)\s"
    r"|\.(?:py|js|ts|rs|go|java|c|cpp|h|rb|sh|sql|json|yaml|toml)\b"
    r"|\b[A-Za-z]+_[A-Za-z_]+\b|\b[A-Z]{3,}\s*=|updated file",
    re.MULTILINE,
)


def _last_user_text(body: Mapping[str, Any]) -> str:
    """The last user message's text (chat messages, Responses `input`, completions `prompt`), cut to the scan."""
    messages = body.get("messages")
    if messages is None:
        messages = body.get("input")
    if isinstance(messages, str):
        return messages[-_SCAN_CHARS:]
    if isinstance(messages, list):
        for message in reversed(messages):
            if isinstance(message, Mapping) and message.get("role", "user") == "user":
                return _text_of(message.get("content"))[-_SCAN_CHARS:]
    prompt = body.get("prompt")
    return prompt[-_SCAN_CHARS:] if isinstance(prompt, str) else ""


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, Mapping)]
        return "\n".join(p for p in parts if isinstance(p, str))
    return ""


def text_kind(body: Mapping[str, Any], copy_hint: bool, copy_share: float | None) -> TextKind:
    """`edit` when the answer copies its context (a pasted file asked back, or a session measured copyable);
    `code` when the request carries tools (an agent) or its last user message speaks of or holds code; else
    `prose`."""
    if copy_hint or (copy_share is not None and copy_share >= 0.3):
        return "edit"
    if body.get("tools"):
        return "code"
    text = _last_user_text(body)
    if _CODE_MARKS.search(text) or _CODE_WORDS.search(text):
        return "code"
    return "prose"
