"""A long first turn's own rate of characters per token, from a count of the texts its pieces are made of."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from adaptive_spec.requests.body.token_rate import MIN_CHARS, first_turn_rate
from adaptive_spec.routing.prompt.pieces import prompt_pieces, prompt_texts
from adaptive_spec.routing.prompt.prefix import tokens_beyond

TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]


def _body(system_chars: int) -> dict[str, Any]:
    messages = [
        {"role": "system", "content": "x" * system_chars},
        {"role": "user", "content": "Add a test."},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Run it."},
    ]
    return {"messages": messages, "tools": TOOLS}


class Counter:
    def __init__(self, per_text: int = 100, delay_s: float = 0.0, fails: bool = False) -> None:
        self.per_text, self.delay_s, self.fails, self.calls = per_text, delay_s, fails, 0

    async def count(self, texts: list[str]) -> list[int]:
        self.calls += 1
        await asyncio.sleep(self.delay_s)
        if self.fails:
            raise OSError("tokenizer gone")
        return [self.per_text] * len(texts)


def test_the_texts_counted_are_the_ones_whose_characters_the_pieces_count() -> None:
    body = _body(3000)
    assert sum(len(t) for t in prompt_texts(body)) == sum(p.chars for p in prompt_pieces(body))


@pytest.mark.asyncio(loop_scope="function")
async def test_a_long_first_turn_gets_its_own_rate() -> None:
    body = _body(MIN_CHARS)
    chars = sum(len(t) for t in prompt_texts(body))
    counter = Counter()
    rate = await first_turn_rate(counter, measured_chars=0, body=body)
    assert rate == pytest.approx(chars / (100 * len(prompt_texts(body))))


@pytest.mark.asyncio(loop_scope="function")
async def test_no_count_for_a_session_measured_on_its_size_a_short_prompt_or_no_tokenizer() -> None:
    counter = Counter()
    chars = sum(len(t) for t in prompt_texts(_body(MIN_CHARS)))
    assert await first_turn_rate(counter, measured_chars=chars // 2, body=_body(MIN_CHARS)) is None
    assert await first_turn_rate(counter, measured_chars=0, body=_body(100)) is None
    assert counter.calls == 0
    assert await first_turn_rate(None, measured_chars=0, body=_body(MIN_CHARS)) is None


@pytest.mark.asyncio(loop_scope="function")
async def test_a_prompt_far_larger_than_its_session_measured_gets_its_own_rate() -> None:
    """Gemini CLI's classifier (2.9k characters) comes before its first turn (44k): the classifier's rate missed the
    first turn by 24%."""
    body = _body(40_000)
    assert await first_turn_rate(Counter(), measured_chars=2_900, body=body) is not None


@pytest.mark.asyncio(loop_scope="function")
async def test_a_slow_or_failing_tokenizer_costs_the_estimate_not_the_request() -> None:
    assert await first_turn_rate(Counter(delay_s=5.0), measured_chars=0, body=_body(MIN_CHARS)) is None  # the deadline
    assert await first_turn_rate(Counter(fails=True), measured_chars=0, body=_body(MIN_CHARS)) is None
    assert await first_turn_rate(Counter(per_text=0), measured_chars=0, body=_body(MIN_CHARS)) is None


def test_the_tokens_beyond_a_restored_head_count_only_the_pieces_after_it() -> None:
    pieces = prompt_pieces(_body(30_000))
    head = 2  # the system prompt and the tools
    beyond = tokens_beyond(pieces, head, chars_per_token=4.0)
    assert 0 < beyond < 100  # three short messages and their markup, not the 30,000-character system prompt
    assert tokens_beyond(pieces, len(pieces), 4.0) >= 1
