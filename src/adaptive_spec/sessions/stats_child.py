"""The session statistics worker process: its tracker, its own tokenizer, and one whole update per call.

Everything proportional to a session's history happens here, off the event loop: parsing the client's bytes, the
pick (which messages are new), tokenizing the new texts and the reply (cached by content hash), the fold (indexing
and the counterfactual replay) and dropping idle sessions. The event loop sends the client's bytes and the reply's
text (no parsed history to pickle) and gets the turn's statistics back: one round trip per served request. A session's
next turn whose first messages are those of the last request folded here is sent only what follows them
(`update`'s `after`): the messages kept are not sent, parsed or read again, their digests taken from that request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from adaptive_spec.common.lru import LRU
from adaptive_spec.sessions import updates
from adaptive_spec.sessions.messages import KnownDigests, message_entry, messages_of, system_entries
from adaptive_spec.sessions.statistics import SessionSnapshot, TurnStats
from adaptive_spec.sessions.tokenizers import SyncTokenizer, TokenizerSpec

_TOKENIZER: list[SyncTokenizer] = []
# Each session's last turn's message digests, by role, length and keyed hash: a turn digests only its new messages.
_KNOWN: LRU[str, KnownDigests] = LRU(4096)


@dataclass(frozen=True, slots=True)
class _Folded:
    """A session's last request folded here: which one, and its context's entries (digest, written by the assistant),
    its `system` entries first (Responses `instructions`, Anthropic `system`), then one per message."""

    request_id: str
    system: int
    entries: list[tuple[bytes, bool]]


_LAST: LRU[str, _Folded] = LRU(4096)


def init(settings: dict[str, Any], spec: TokenizerSpec) -> None:
    """The process's initializer: an empty tracker like the proxy's, and the proxy's tokenizer made again."""
    updates.process_init(settings)
    _TOKENIZER[:] = [SyncTokenizer(spec)]
    if spec.kind == "gguf":  # its faster encoder is made on first use: here, before the first turn
        _TOKENIZER[0].encode(["ready"])
    _KNOWN.max_items = _LAST.max_items = updates.process_tracker().max_sessions


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
    request_id: str = "",
    after: tuple[str, int] | None = None,
) -> tuple[TurnStats, SessionSnapshot | None, list[str]] | None:
    """One served request folded into its session's statistics; then the sessions idle since before `now` go.

    `after` = (request id, n): the request's first n messages are those of that request, the session's last one
    folded here, and `raw_body` is the body without them (its system prompt kept apart, and the messages that
    follow). None, with nothing folded, when that is not enough: that request is not the last one folded here (the
    worker started again, the session was dropped, an update was dropped or joined another) or the pick wants a
    message not sent (the session's statistics forgot it); the caller then sends the whole body."""
    kept: list[tuple[bytes, bool]] = []
    if after is not None:
        last = _LAST.get(session_id)
        if last is None or last.request_id != after[0] or after[1] > len(last.entries) - last.system:
            return None
        kept = last.entries[last.system : last.system + after[1]]
    body = orjson.loads(raw_body)
    known = _known(session_id)
    system = [(known(role, text), assistant) for role, assistant, text, _ in system_entries(body)]
    new = [(known(role, text), assistant) for role, assistant, text, _ in map(message_entry, messages_of(body))]
    entries = [*system, *kept, *new]
    tracker = updates.process_tracker()
    pick = tracker.pick(session_id, entries)
    first_new = len(system) + len(kept)
    if any(len(system) <= i < first_new for i in pick):
        return None  # the whole body's update picks again (a pick not folded is void)
    known.turn()
    # The picked entries' texts, at their indices in the body sent (which lacks the kept messages).
    picked = updates.picked_texts(body, [i if i < len(system) else i - len(kept) for i in pick])
    tokens = _TOKENIZER[0].encode([*(text for _, text in picked), output_text])
    digests = [digest for digest, _ in entries]
    job = updates.FoldJob(
        session_id, project, tokens[:-1], output_text, tokens[-1], at, side, line_moved, digests, turns,
        [role for role, _ in picked], output_calls,
    )  # fmt: skip
    turn, snap = updates.fold_update(tracker, job, digests)
    _LAST.put(session_id, _Folded(request_id, len(system), entries))
    gone = tracker.expire(now)
    for sid in gone:
        _KNOWN.pop(sid)
        _LAST.pop(sid)
    return turn, snap, gone


def _known(session_id: str) -> KnownDigests:
    known = _KNOWN.get(session_id)
    if known is None:
        known = KnownDigests()
        _KNOWN.put(session_id, known)
    _KNOWN.touch(session_id)
    return known
