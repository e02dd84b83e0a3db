"""A head's bytes before it is saved (`kv/heads/matching.py` `head_size`): fitted to the saved heads as a fixed part and
a part per token, per token alone where their lengths do not tell the two apart or the fit is not a size. The real slot
files' fit is tests/integration/heads/test_head_bytes.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from adaptive_spec.kv.heads.book import HeadBook
from adaptive_spec.kv.heads.matching import HeadEntry, HeadSize, head_size


def _heads(*sizes: tuple[int, int]) -> list[HeadEntry]:
    return [HeadEntry(str(i), ("x",), (1,), t, t, b, 0.0, 0.0) for i, (t, b) in enumerate(sizes)]


def test_without_heads_the_prior_per_token() -> None:
    assert head_size([], 120_000.0) == HeadSize(0.0, 120_000.0)
    assert head_size([], 120_000.0).bytes_for(10) == 1_200_000


def test_heads_of_two_lengths_give_the_fixed_part_and_the_part_per_token() -> None:
    size = head_size(_heads((1000, 5_000_000 + 1000 * 300), (3000, 5_000_000 + 3000 * 300)), 1.0)
    assert size.fixed_bytes == pytest.approx(5_000_000) and size.bytes_per_token == pytest.approx(300)
    assert size.bytes_for(8000) == 5_000_000 + 8000 * 300


def test_the_fit_is_least_squares_over_every_head() -> None:
    size = head_size(_heads((100, 1_100), (200, 2_050), (300, 3_000)), 1.0)
    assert size.bytes_per_token == pytest.approx(9.5) and size.fixed_bytes == pytest.approx(2_050 - 9.5 * 200)


@pytest.mark.parametrize(
    ("sizes", "per_token"),
    [
        ([(1000, 12_000_000)], 12_000.0),  # one length: its bytes over its tokens
        ([(1000, 12_000_000), (1000, 14_000_000)], 13_000.0),
        ([(1000, 90_000_000), (3000, 30_000_000)], 30_000.0),  # bigger for fewer tokens: two models mixed
        ([(1000, 1_000_000), (2000, 10_000_000)], 11_000_000 / 3000),  # the fit's fixed part would be negative
        ([(0, 500), (1000, 12_000_000)], 12_000.0),  # a head with no tokens is not a length
    ],
)
def test_per_token_alone_where_the_lengths_do_not_tell_the_parts_apart(
    sizes: list[tuple[int, int]], per_token: float
) -> None:
    size = head_size(_heads(*sizes), 1.0)
    assert size.fixed_bytes == 0.0 and size.bytes_per_token == pytest.approx(per_token)


@pytest.mark.asyncio(loop_scope="function")
async def test_the_book_sizes_a_new_head_by_the_fit_not_by_the_mean_per_token(tmp_path: Path) -> None:
    """A hybrid's heads: 5 MB of recurrent state and checkpoints, 300 bytes a token. A head of 8,000 tokens is 7.4 MB
    and fits a 12 MB share; the mean per token of the two saved (2,800 bytes) would make it 22 MB and refuse it."""
    book = HeadBook(tmp_path / "heads", max_bytes=12_000_000)
    for head in _heads((1000, 5_300_000), (3000, 5_900_000)):
        await book.add(head)
    assert book.head_size().bytes_for(8000) == 7_400_000
    assert await book.room(prompt_tokens=8000)
    assert not await book.room(prompt_tokens=30_000)  # 14 MB


@pytest.mark.asyncio(loop_scope="function")
async def test_a_new_head_is_sized_by_the_heads_of_its_own_server_key(tmp_path: Path) -> None:
    """A store that holds a dense model's heads (12,304 bytes a token, no fixed part) beside a hybrid's (5 MB fixed,
    300 a token): a hybrid head of 8,000 tokens is 7.4 MB, not what a fit over both would say."""
    book = HeadBook(tmp_path / "heads", max_bytes=10**12)
    dense = [replace(h, key="dense") for h in _heads((700, 700 * 12_304), (3900, 3900 * 12_304))]
    hybrid = [replace(h, id=f"h{h.id}", key="hybrid") for h in _heads((1000, 5_300_000), (3000, 5_900_000))]
    for head in (*dense, *hybrid):
        await book.add(head)
    assert book.head_size("hybrid").bytes_for(8000) == 7_400_000
    assert book.head_size("dense").bytes_for(8000) == pytest.approx(8000 * 12_304)
    assert book.head_size("another").bytes_for(8000) == book.head_size().bytes_for(8000)  # none of its own: all
    assert book.head_size().bytes_for(8000) != 7_400_000
