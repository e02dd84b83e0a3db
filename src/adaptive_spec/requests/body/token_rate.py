"""A long first turn counted with the model's own tokenizer before it is routed.

Its new-token estimate is otherwise characters over a rate learned from earlier sessions (3.5 before any), which missed
an opencode-shaped first turn by a third; a count of its texts (`sessions/pieces.prompt_texts`) gives this prompt's own
rate. Only for a session the router has measured no prompt of this size for (none yet, or one less than half this
one's characters: Gemini CLI's 2.9k-character classifier before its 44k-character first turn, estimated 24% high at the
classifier's rate), and only for a prompt long enough that its prefill takes seconds: a short one never waits for it.
The count has a deadline and falls back to the learned rate."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, Protocol

from adaptive_spec.routing.prompt.pieces import prompt_texts

log = logging.getLogger(__name__)
# ~500 tokens: seconds of prefill on a CPU, against a count of a millisecond or two. From 8,000 characters, the first
# turns of pi (5,342) and Continue CLI (7,275) were estimated at the learned rate, 28% high at the default 3.5.
MIN_CHARS = 2_000
DEADLINE_S = 0.5  # a tokenizer slower than this (a busy server's /tokenize) is not waited for


class Counter(Protocol):
    async def count(self, texts: list[str]) -> list[int]: ...


async def first_turn_rate(counter: Counter | None, measured_chars: int, body: Mapping[str, Any]) -> float | None:
    """This prompt's characters per token, or None (a session measured on a prompt of half this size or more, a short
    prompt, no tokenizer, or no answer in time). `measured_chars`: the characters of the session's last prompt, whose
    rate the router measured (`Router.measured_chars`; 0: none)."""
    if counter is None:
        return None
    texts = prompt_texts(body)
    chars = sum(len(text) for text in texts)
    if chars < MIN_CHARS or chars <= 2 * measured_chars:
        return None
    try:
        async with asyncio.timeout(DEADLINE_S):
            tokens = sum(await counter.count(texts))
    except Exception as exc:  # any tokenizer's failure costs the estimate its accuracy, never the request
        log.debug("first turn not counted (%s): estimated from the learned rate", exc or type(exc).__name__)
        return None
    return chars / tokens if tokens > 0 else None
