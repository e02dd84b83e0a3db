"""What a request's prompt says before its session has a history to measure, in two readings.

The copy hint: whether a prompt asks for a pasted file back whole, and how long that answer will be. Such an answer
copies the prompt, so n-gram drafting pays from the first token. A long text's blocks are found once: the next turns
that carry it again take what was found.

The text's kind, for the drafter's acceptance prior: code being edited, code written fresh, or prose and chat. A
model drafter guesses code far better than prose (llama.cpp #23052: prose at 0.68-0.91× with a drafter). Cheap: it
reads the request's tools and its last user message (at most `_SCAN_CHARS` of it), never the history. The session's
own measured acceptance replaces the prior after its first drafted answer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from adaptive_spec.common.lru import LRU
from adaptive_spec.policy.model import FirstTurnPolicy
from adaptive_spec.sessions.messages import message_text, messages_of

_HINT_MESSAGES = 12  # how far back a pasted file is looked for

_FENCE = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.S)
# Texts from this size on keep their longest block, by length and keyed hash (process-local), for the next turns.
_REMEMBERED_CHARS = 4096
_LONGEST: LRU[tuple[int, int], tuple[int, int]] = LRU(4096)


def looks_copy_heavy(instruction: str, policy: FirstTurnPolicy, earlier: Sequence[str] = ()) -> bool:
    """A request that asks for a file back whole ('return the complete updated file') with a block of at least
    `min_lines` lines pasted in this message or an earlier one: its answer copies the prompt, so n-gram drafting
    pays from the first token."""
    return pasted_chars(instruction, policy, earlier) > 0


def pasted_chars(instruction: str, policy: FirstTurnPolicy, earlier: Sequence[str] = ()) -> int:
    """The size of the file a copy-heavy request asks for back (the longest qualifying block), 0 when it is not
    one: the answer will be about that long."""
    if not _asks_back(instruction, policy):
        return 0
    sizes = [
        size for text in (instruction, *earlier) for lines, size in [_longest_block(text)] if lines >= policy.min_lines
    ]
    return max(sizes, default=0)


def _asks_back(instruction: str, policy: FirstTurnPolicy) -> bool:
    """Whether the instruction says one of the policy's phrases (case-insensitive)."""
    phrases = _LOWERED.get(policy.phrases)
    if phrases is None:
        if len(_LOWERED) >= 64:  # policy files edited many times over
            _LOWERED.clear()
        phrases = _LOWERED[policy.phrases] = tuple(phrase.lower() for phrase in policy.phrases)
    lowered = instruction.lower()
    return any(phrase in lowered for phrase in phrases)


# Each policy's phrases, lowered once (a policy file's are few and change rarely).
_LOWERED: dict[tuple[str, ...], tuple[str, ...]] = {}


def _longest_block(text: str) -> tuple[int, int]:
    """(lines, chars) of the longest fenced block, or of the whole text when it has no fences (a pasted file)."""
    if len(text) < _REMEMBERED_CHARS:
        return _scan(text)
    key = (len(text), hash(text))
    found = _LONGEST.get(key)
    if found is None:
        found = _scan(text)
        _LONGEST.put(key, found)
    return found


def _scan(text: str) -> tuple[int, int]:
    blocks = _FENCE.findall(text)
    if blocks:
        longest = max(blocks, key=len)
        return longest.count("\n") + 1, len(longest)
    return text.count("\n") + 1, len(text)


def pasted_file_chars(body: Mapping[str, Any], policy: FirstTurnPolicy) -> int:
    """Chars of the pasted file the last user message asks for back whole, 0 when it does not (`pasted_chars`)."""
    messages = messages_of(body)[-_HINT_MESSAGES:]
    last = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == "user"), None)
    if last is None:
        prompt = body.get("prompt")
        return pasted_chars(prompt[-4000:], policy, (prompt,)) if isinstance(prompt, str) else 0
    instruction = message_text(messages[last].get("content"))
    if not _asks_back(instruction, policy):
        return 0  # the usual answer, found without reading the messages before it
    earlier = [message_text(m.get("content")) for m in messages[:last]]
    return pasted_chars(instruction, policy, earlier)


# --- the text's kind ---------------------------------------------------------------------------------------------

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
