"""The session statistics worker process: its tracker, its own tokenizer, and one whole update per call.

Everything proportional to a session's history happens here, off the event loop: parsing the client's bytes, the
plan (which messages are new), tokenizing the new texts and the reply (cached by content hash), the fold (indexing
and the counterfactual replay) and dropping idle sessions. The event loop sends the client's bytes and the reply's
text (no parsed history to pickle) and gets the turn's statistics back: one round trip per served request.
"""

from __future__ import annotations

from typing import Any

import orjson

from adaptive_spec.core.sessions import updates
from adaptive_spec.core.sessions.grouping import context_texts
from adaptive_spec.core.sessions.statistics import SessionSnapshot, TurnStats
from adaptive_spec.proxy.tokenizers import SyncTokenizer, TokenizerSpec

_TOKENIZER: list[SyncTokenizer] = []


def init(settings: dict[str, Any], spec: TokenizerSpec) -> None:
    """The process's initializer: an empty tracker like the proxy's, and the proxy's tokenizer made again."""
    updates.process_init(settings)
    _TOKENIZER[:] = [SyncTokenizer(spec)]


def update(
    session_id: str,
    project: str,
    raw_body: bytes,
    output_text: str,
    at: float,
    side: bool,
    line_moved: bool,
    now: float,
) -> tuple[TurnStats, SessionSnapshot | None, list[str]]:
    """One served request folded into its session's statistics; then the sessions idle since before `now` go."""
    tracker = updates.process_tracker()
    body = orjson.loads(raw_body)
    plan, digests = updates.plan_update(tracker, session_id, body)
    wanted = set(plan)
    texts = [text for i, (_, _, text) in enumerate(context_texts(body)) if i in wanted]
    tokens = _TOKENIZER[0].encode([*texts, output_text])
    job = updates.FoldJob(session_id, project, tokens[:-1], output_text, tokens[-1], at, side, line_moved, digests)
    turn, snap = updates.fold_update(tracker, job, digests)
    return turn, snap, tracker.expire(now)
