"""The session statistics worker process: its tracker, its own tokenizer, and one whole update per call.

Everything proportional to a session's history happens here, off the event loop: parsing the client's bytes, the
plan (which messages are new), tokenizing the new texts and the reply (cached by content hash), the fold (indexing
and the counterfactual replay) and dropping idle sessions. The event loop sends the client's bytes and the reply's
text (no parsed history to pickle) and gets the turn's statistics back: one round trip per served request. A session's
next turn whose first messages are those of the last request folded here is sent only what follows them
(`update_after`): the messages kept are not sent, parsed or read again, their digests taken from that request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from adaptive_spec.common.lru import LRU
from adaptive_spec.sessions import updates
from adaptive_spec.sessions.grouping import KnownDigests, context_messages, message_entry, messages_of, system_entries
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
) -> tuple[TurnStats, SessionSnapshot | None, list[str]]:
    """One served request folded into its session's statistics; then the sessions idle since before `now` go."""
    body = orjson.loads(raw_body)
    known = _known(session_id)
    messages = context_messages(body, known)
    known.turn()
    system = sum(1 for _ in system_entries(body))
    entries = [(digest, assistant) for digest, assistant, _ in messages]
    plan = updates.process_tracker().plan(session_id, entries)
    return _fold(session_id, project, body, plan, entries, system, output_text, at, side, line_moved, now, turns,
                 output_calls, request_id)  # fmt: skip


def update_after(
    session_id: str,
    project: str,
    after: str,
    same: int,
    raw_rest: bytes,
    output_text: str,
    at: float,
    side: bool,
    line_moved: bool,
    now: float,
    turns: int = 1,
    output_calls: bool = False,
    request_id: str = "",
) -> tuple[TurnStats, SessionSnapshot | None, list[str]] | None:
    """`update` of a request whose first `same` messages are those of request `after`, the session's last one folded
    here: `raw_rest` is the body without them (its system prompt kept apart, and the messages that follow). None,
    with nothing folded, when that is not enough: `after` is not the last request folded here (the worker started
    again, the session was dropped, an update was dropped or joined another) or the plan wants a message not sent
    (the session's statistics forgot it); the caller then sends the whole body."""
    last = _LAST.get(session_id)
    if last is None or last.request_id != after or same > len(last.entries) - last.system:
        return None
    rest = orjson.loads(raw_rest)
    known = _known(session_id)
    system = [(known(role, text), assistant) for role, assistant, text, _ in system_entries(rest)]
    new = [(known(role, text), assistant) for role, assistant, text, _ in map(message_entry, messages_of(rest))]
    entries = [*system, *last.entries[last.system : last.system + same], *new]
    tracker = updates.process_tracker()
    plan = tracker.plan(session_id, entries)
    first_new = len(system) + same
    if any(len(system) <= i < first_new for i in plan):
        return None  # the whole body's update plans again (a plan not folded is void)
    known.turn()
    # The planned entries' indices in `rest`, which lacks the kept messages.
    shifted = [i if i < len(system) else i - same for i in plan]
    return _fold(session_id, project, rest, plan, entries, len(system), output_text, at, side, line_moved, now, turns,
                 output_calls, request_id, shifted)  # fmt: skip


def _known(session_id: str) -> KnownDigests:
    known = _KNOWN.get(session_id)
    if known is None:
        known = KnownDigests()
        _KNOWN.put(session_id, known)
    _KNOWN.touch(session_id)
    return known


def _fold(
    session_id: str,
    project: str,
    body: dict[str, Any],
    plan: list[int],
    entries: list[tuple[bytes, bool]],
    system: int,
    output_text: str,
    at: float,
    side: bool,
    line_moved: bool,
    now: float,
    turns: int,
    output_calls: bool,
    request_id: str,
    in_body: list[int] | None = None,
) -> tuple[TurnStats, SessionSnapshot | None, list[str]]:
    """Tokenize the planned texts (at `in_body`'s indices of `body`, when they differ from the plan's) and the
    reply, fold them in, and drop the sessions idle since before `now`."""
    tracker = updates.process_tracker()
    planned = updates.planned_texts(body, plan if in_body is None else in_body)
    tokens = _TOKENIZER[0].encode([*(text for _, text in planned), output_text])
    digests = [digest for digest, _ in entries]
    job = updates.FoldJob(
        session_id, project, tokens[:-1], output_text, tokens[-1], at, side, line_moved, digests, turns,
        [role for role, _ in planned], output_calls,
    )  # fmt: skip
    turn, snap = updates.fold_update(tracker, job, digests)
    _LAST.put(session_id, _Folded(request_id, system, entries))
    gone = tracker.expire(now)
    for sid in gone:
        _KNOWN.pop(sid)
        _LAST.pop(sid)
    return turn, snap, gone
