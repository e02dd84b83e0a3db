"""One session-statistics update in two steps, wherever the proxy runs it: which messages are new (`pick_update`), then
indexing them and replaying the response (`fold_update`); tokenizing the new texts happens in between, in the proxy.

Everything here grows with the history, so the proxy keeps it off its event loop: in a worker process that holds the
tracker (the `process_*` functions, called through a one-process pool), or in a thread.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from adaptive_spec.sessions.messages import context_entries, context_messages, message_digest
from adaptive_spec.sessions.statistics import ContextTracker, SessionSnapshot, TurnStats


@dataclass(frozen=True, slots=True)
class FoldJob:
    session_id: str
    project: str
    new_tokens: Sequence[Sequence[int]]  # the picked messages' tokens, in order
    output_text: str
    output_tokens: Sequence[int]
    at: float
    side: bool = False
    line_moved: bool = False
    digests: Sequence[bytes] | None = None  # every message's digest; None: those the pick of this session kept
    turns: int = 1  # the session's turns this update stands for (updates that waited together are folded as one)
    new_roles: Sequence[str] = ()  # the picked messages' roles, in order ("calls": a message of tool calls)
    output_calls: bool = False  # the response is tool calls


def pick_update(
    tracker: ContextTracker,
    session_id: str,
    body: Mapping[str, Any],
    digest: Callable[[str, str], bytes] | None = None,
) -> tuple[list[int], list[bytes]]:
    """(indices of the messages to tokenize and index, every message's digest); `digest` as `context_messages`."""
    messages = context_messages(body, digest)
    pick = tracker.pick(session_id, [(digest, assistant) for digest, assistant, _ in messages])
    return pick, [digest for digest, _, _ in messages]


def picked_texts(body: Mapping[str, Any], pick: Sequence[int]) -> list[tuple[str, str]]:
    """(framing role, text) of the picked messages, in order: a message of tool calls is framed as "calls"."""
    wanted = set(pick)
    return [
        ("calls" if calls else role, text)
        for i, (role, _, text, calls) in enumerate(context_entries(body, wanted))
        if i in wanted
    ]


def fold_update(
    tracker: ContextTracker, job: FoldJob, digests: Sequence[bytes]
) -> tuple[TurnStats, SessionSnapshot | None]:
    if job.line_moved:
        tracker.demote(job.session_id)
    tracker.on_prompt(job.session_id, job.project, digests, job.new_tokens, job.at, job.new_roles)
    reply = message_digest("assistant", job.output_text)
    turn = tracker.on_output(
        job.session_id, job.project, reply, job.output_tokens, job.at, side=job.side, turns=job.turns,
        calls=job.output_calls,
    )  # fmt: skip
    return turn, tracker.snapshot(job.session_id)


# The worker process's side: its tracker, and the digests a pick computed until the fold that follows it.
_TRACKER: list[ContextTracker] = []
_PICKED: dict[str, list[bytes]] = {}


def tracker_settings(tracker: ContextTracker) -> dict[str, Any]:
    """What it takes to make an empty tracker like this one in another process."""
    return {
        "params": tracker.params,
        "max_sessions": tracker.max_sessions,
        "max_tokens": tracker.max_tokens,
        "idle_expiry_s": tracker.idle_expiry_s,
        "ewma_alpha": tracker.alpha,
        "keep_turns": tracker.keep_turns,
        "opening_tokens": tracker.opening_tokens,
    }


def process_init(settings: dict[str, Any]) -> None:
    settings = dict(settings)
    _TRACKER[:] = [ContextTracker(settings.pop("params"), **settings)]


def process_tracker() -> ContextTracker:
    """The worker process's tracker (`process_init` made it)."""
    return _TRACKER[0]


def process_pick(session_id: str, body: Mapping[str, Any]) -> list[int]:
    pick, digests = pick_update(_TRACKER[0], session_id, body)
    _PICKED.clear()  # one update at a time: an unfinished one's digests are stale
    _PICKED[session_id] = digests
    return pick


def process_fold(job: FoldJob) -> tuple[TurnStats, SessionSnapshot | None]:
    digests = job.digests if job.digests is not None else _PICKED.pop(job.session_id, [])
    return fold_update(_TRACKER[0], job, digests)


def process_fold_expire(job: FoldJob, now: float) -> tuple[TurnStats, SessionSnapshot | None, list[str]]:
    """`process_fold`, then `process_expire`: one round trip per update."""
    turn, snap = process_fold(job)
    return turn, snap, process_expire(now)


def process_expire(now: float) -> list[str]:
    return _TRACKER[0].expire(now)
