"""The copy-hint analysis: whether a prompt asks for a pasted file back whole, and how long that answer will be.
Such an answer copies the prompt, so n-gram drafting pays from the first token, before the session has history.
A long text's blocks are found once: the next turns that carry it again take what was found."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from adaptive_spec.common.lru import LRU
from adaptive_spec.routing.policy import FirstTurnPolicy
from adaptive_spec.sessions.grouping import message_text, messages_of

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
    lowered = instruction.lower()
    if not any(phrase.lower() in lowered for phrase in policy.phrases):
        return 0
    sizes = [
        size for text in (instruction, *earlier) for lines, size in [_longest_block(text)] if lines >= policy.min_lines
    ]
    return max(sizes, default=0)


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
    earlier = [message_text(m.get("content")) for m in messages[:last]]
    return pasted_chars(message_text(messages[last].get("content")), policy, earlier)
