"""The head restore a route asks for (`kv/heads/choice.py`), as tables: which head, whether it pays, a slot that
holds it already, and the new tokens the request prefills after it."""

from __future__ import annotations

import pytest

from adaptive_spec.kv.costs import PrefillRate
from adaptive_spec.kv.heads.choice import choose_head, tokens_after
from adaptive_spec.kv.heads.matching import HeadEntry, Match, ServerKey, chain
from adaptive_spec.kv.heads.values import HeadsView, Restored
from adaptive_spec.kv.moves import SlotAt

KEY = ServerKey("/models/qwen.gguf", 491_400_064, 8192, "t1")
PIECES = [b"system", b"tools", b"user-1"]
AT = SlotAt("p", 0, 0)
SLOW = PrefillRate(1 / 60)  # 60 tokens a second: a CPU's prefill
FAST = PrefillRate(1 / 50_000)


def _entry(pieces: list[bytes], tokens: int = 7000, size: int = 100_000_000, scope: str = "") -> HeadEntry:
    links = chain(KEY, pieces, scope)
    return HeadEntry(links[-1][:24], links, (4000, 5000, 1000)[: len(links)], tokens, tokens + 4, size, 0.0, 0.0)


def _view(*entries: HeadEntry, held: dict[int, Restored] | None = None, scope: str = "") -> HeadsView:
    return HeadsView("http://server", KEY, scope, entries, held or {}, 400e6, any_prefix=False)


@pytest.mark.parametrize(
    ("entries", "slot_tokens", "prefill", "pieces", "tokens"),
    [
        ([_entry(PIECES)], 0, SLOW, PIECES, 7000),  # the whole head: restored
        ([_entry(PIECES)], 0, SLOW, [*PIECES[:2], b"user-2"], 6300),  # its system prompt and tools
        ([_entry(PIECES[:2], 6300), _entry(PIECES)], 0, SLOW, PIECES, 7000),  # the longest match
        ([_entry(PIECES)], 0, FAST, PIECES, None),  # a fast prefill beats reading 100 MB
        ([_entry(PIECES)], 6990, SLOW, PIECES, None),  # the slot holds nearly all of it already
        ([_entry(PIECES)], 0, SLOW, [b"another system"], None),  # nothing shared
        ([_entry(PIECES, scope="tenant-a")], 0, SLOW, PIECES, None),  # another tenant's head
        ([], 0, SLOW, PIECES, None),
    ],
)
def test_the_head_restored_is_the_longest_match_when_it_pays(
    entries: list[HeadEntry], slot_tokens: int, prefill: PrefillRate, pieces: list[bytes], tokens: int | None
) -> None:
    move = choose_head(_view(*entries), pieces, (), AT, slot_tokens, prefill)
    assert (move.match.tokens if move is not None else None) == tokens, move
    if move is not None:
        assert move.at == AT and move.server == "http://server" and move.held is None
        assert 0 < move.restore_s < move.prefill_s


def test_a_slot_that_holds_the_head_needs_no_restore() -> None:
    head = _entry(PIECES)
    at_start = Restored(head.id, "http://server", tokens=7000, restore_ms=30.0, at_start=True)
    move = choose_head(_view(head, held={0: at_start}), [*PIECES[:2], b"user-2"], (), AT, 0, SLOW)
    assert move is not None and move.held is not None, move  # a warm start put it there: counted, not restored
    assert (move.held.tokens, move.held.pieces, move.held.head_tokens) == (6300, 2, 7000)
    saved = Restored(head.id, "http://server", tokens=7000, restore_ms=0.0)
    assert choose_head(_view(head, held={0: saved}), PIECES, (), AT, 0, SLOW) is None  # saved from there
    other_slot = choose_head(_view(head, held={1: at_start}), PIECES, (), AT, 0, SLOW)
    assert other_slot is not None and other_slot.held is None  # held in another slot: restored into this one


@pytest.mark.parametrize(
    ("new_tokens", "beyond", "match", "expected"),
    [
        (7100, 100, Match(_entry(PIECES), 3, 7000), 100),  # the pieces after the head's
        (7100, 1500, Match(_entry(PIECES), 2, 6300, blocks=2), 1500 - 128),  # less its blocks of the next piece
        (50, 100, Match(_entry(PIECES), 3, 7000), 50),  # never more than estimated without it
        (7100, 7100, Match(_entry(PIECES), 0, 512, blocks=8), 7100 - 512),  # blocks of its first piece alone
        (7100, 7100, Match(_entry(PIECES), 0, 7000), 100),  # shares no piece: its own tokens saved
        (300, 300, Match(_entry(PIECES), 0, 7000), 1),
    ],
)
def test_the_new_tokens_after_a_restore(new_tokens: int, beyond: int, match: Match, expected: int) -> None:
    assert tokens_after(new_tokens, beyond, match, chars_per_token=4.0) == expected
