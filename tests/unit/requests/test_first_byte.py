"""The wait for a server's first byte (requests/forwarding/stranded.py `first_byte`, `StrandedRequests.answered_at`):
the read timeout counts the server's silence, not a wait in its queue behind another request's answer."""

from __future__ import annotations

import asyncio
import time

import pytest

from adaptive_spec.requests.forwarding.stranded import StrandedRequests, first_byte

SILENCE = 0.1


async def _never() -> str:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def _after(seconds: float) -> str:
    await asyncio.sleep(seconds)
    return "answer"


@pytest.mark.asyncio
async def test_a_silent_server_times_out_after_the_silence() -> None:
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        await first_byte(_never(), SILENCE, lambda: float("-inf"))
    assert SILENCE <= time.monotonic() - t0 < 3 * SILENCE


@pytest.mark.asyncio
async def test_a_request_queued_behind_an_answer_waits_and_its_silence_counts_from_that_answers_end() -> None:
    t0 = time.monotonic()
    ends = t0 + 4 * SILENCE  # another request is answered for four periods

    def answered_at() -> float | None:
        return None if time.monotonic() < ends else ends

    assert await first_byte(_after(3 * SILENCE), SILENCE, answered_at) == "answer"
    t0 = time.monotonic()
    ends = t0 + 3 * SILENCE
    with pytest.raises(TimeoutError):
        await first_byte(_never(), SILENCE, answered_at)
    assert time.monotonic() - t0 >= 3 * SILENCE + SILENCE * 0.9  # not before the other answer's end + the silence


@pytest.mark.asyncio
async def test_no_read_timeout_waits_as_long_as_it_takes() -> None:
    assert await first_byte(_after(2 * SILENCE), None, lambda: None) == "answer"


@pytest.mark.asyncio
async def test_the_book_says_when_a_server_last_answered_another_request() -> None:
    book = StrandedRequests()
    with book.book("s", "p") as mine:
        assert book.answered_at("s", mine) == float("-inf")  # nothing answered there yet
        with book.book("s", "p") as other:
            other.answered = True
            assert book.answered_at("s", mine) is None  # answering it now
            assert book.answered_at("s", other) == float("-inf")  # not counting itself
        after = book.answered_at("s", mine)
        assert after is not None and after <= time.monotonic()
        with book.book("t", "q") as elsewhere:
            assert book.answered_at("t", elsewhere) == float("-inf")  # another server's answers do not count


@pytest.mark.asyncio
async def test_a_server_at_work_is_waited_for_past_the_silence_and_one_that_is_not_times_out() -> None:
    """An answer sent whole at its end (or a stream's first token after a long prefill) comes after more silence
    than the read timeout on a slow machine: while the server says it is at work, the silence counts again."""
    asked: list[float] = []

    async def at_work(wait_s: float) -> bool:
        asked.append(wait_s)
        return True

    assert await first_byte(_after(4 * SILENCE), SILENCE, lambda: float("-inf"), at_work) == "answer"
    assert len(asked) >= 2 and all(w == SILENCE for w in asked)  # asked at each deadline, given the silence to say

    async def idle(wait_s: float) -> bool:
        return False

    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        await first_byte(_never(), SILENCE, lambda: float("-inf"), idle)
    assert SILENCE <= time.monotonic() - t0 < 3 * SILENCE
