"""Pure: the head restore a route asks for, chosen from what the store showed of a server (`HeadsView`): the stored head
sharing most with the prompt, nothing when the slot holds it already, else priced against the prefill it saves; and
the new tokens the request then prefills.

The router calls it while it plans (`routing/move_planner.py`); the head store carries the restore out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from adaptive_spec.kv.costs import PrefillRate
from adaptive_spec.kv.heads.matching import BLOCK_CHARS, Match, best_match, block_chains, chain, price
from adaptive_spec.kv.heads.values import HeadsView
from adaptive_spec.kv.moves import HeadRestore, SlotAt


def choose_head(
    view: HeadsView,
    pieces: Sequence[bytes],
    blocks: Sequence[Sequence[bytes]],
    at: SlotAt,
    slot_tokens: int,
    prefill: PrefillRate,
) -> HeadRestore | None:
    """The restore into `at` of the head of `view` sharing most with a prompt of these piece digests (and each piece's
    `text_blocks`, counted on a server that resumes at any token), when it pays against prefilling what it brings
    beyond the `slot_tokens` the slot holds; None otherwise. A slot that holds that head since its server started
    (a warm start) needs no restore: the move only counts it."""
    links = chain(view.key, pieces, view.scope)
    fine = block_chains(view.key, links, blocks, view.scope) if view.any_prefix else ()
    match = best_match(links, view.entries, fine)
    if match is None:
        return None
    held = view.held.get(at.slot or 0)
    if held is not None and held.head == match.entry.id:
        if not held.at_start:
            return None  # saved from there, and no request came since: the slot holds it
        shown = replace(
            held, tokens=match.tokens, pieces=match.pieces, blocks=match.blocks, head_tokens=match.entry.prompt_tokens
        )
        return HeadRestore(at, view.server, match, 0.0, 0.0, held=shown)
    cost = price(match, slot_tokens, prefill, view.restore_bytes_per_s)
    if not cost.pays:
        return None
    return HeadRestore(at, view.server, match, cost.restore_s, cost.prefill_s)


def tokens_after(new_tokens: int, beyond: int, match: Match, chars_per_token: float) -> int:
    """The new tokens of a prompt once `match` is restored: the `beyond` tokens of its pieces after the head's, less
    the blocks of the piece it parts from the head in; a head it shares no piece or block with saves its own tokens.
    Never more than the `new_tokens` estimated without it."""
    if match.pieces or match.blocks:
        return min(new_tokens, max(1, beyond - round(match.blocks * BLOCK_CHARS / chars_per_token)))
    return max(1, new_tokens - match.tokens)
