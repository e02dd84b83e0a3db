"""The session statistics worker process: its tracker, its own tokenizer, and one whole update per call.

Everything proportional to a session's history happens here, off the event loop: parsing the client's bytes, the
plan (which messages are new), tokenizing the new texts and the reply (cached by content hash), the fold (indexing
and the counterfactual replay) and dropping idle sessions. The event loop sends the client's bytes and the reply's
text (no parsed history to pickle) and gets the turn's statistics back: one round trip per served request.
"""

from __future__ import annotations

from typing import Any

import orjson

from adaptive_spec.common.lru import LRU
from adaptive_spec.sessions import updates
from adaptive_spec.sessions.grouping import KnownDigests
from adaptive_spec.sessions.statistics import SessionSnapshot, TurnStats
from adaptive_spec.sessions.tokenizers import SyncTokenizer, TokenizerSpec

_TOKENIZER: list[SyncTokenizer] = []
# Each session's last turn's message digests, by role, length and keyed hash: a turn digests only its new messages.
_KNOWN: LRU[str, KnownDigests] = LRU(4096)


def init(settings: dict[str, Any], spec: TokenizerSpec) -> None:
    """The process's initializer: an empty tracker like the proxy's, and the proxy's tokenizer made again."""
    updates.process_init(settings)
    _TOKENIZER[:] = [SyncTokenizer(spec)]
    if spec.kind == "gguf":  # its faster encoder is made on first use: here, before the first turn
        _TOKENIZER[0].encode(["ready"])
    _KNOWN.max_items = updates.process_tracker().max_sessions


def update(
    session_id: str,
    project: str,
    raw_body: bytes,
    output_text: str,
    at: float,
    side: bool,
    line_moved: bool,
    now: float,
    turns: int = 1,
    output_calls: bool = False,
) -> tuple[TurnStats, SessionSnapshot | None, list[str]]:
    """One served request folded into its session's statistics; then the sessions idle since before `now` go."""
    tracker = updates.process_tracker()
    body = orjson.loads(raw_body)
    known = _KNOWN.get(session_id)
    if known is None:
        known = KnownDigests()
        _KNOWN.put(session_id, known)
    _KNOWN.touch(session_id)
    plan, digests = updates.plan_update(tracker, session_id, body, known)
    known.turn()
    planned = updates.planned_texts(body, plan)
    tokens = _TOKENIZER[0].encode([*(text for _, text in planned), output_text])
    job = updates.FoldJob(
        session_id, project, tokens[:-1], output_text, tokens[-1], at, side, line_moved, digests, turns,
        [role for role, _ in planned], output_calls,
    )  # fmt: skip
    turn, snap = updates.fold_update(tracker, job, digests)
    gone = tracker.expire(now)
    for sid in gone:
        _KNOWN.pop(sid)
    return turn, snap, gone
