"""Per-session repeated-context statistics: how much of each new prompt repeats earlier context, and what an
n-gram drafter would have made of each response (a counterfactual estimate, whichever profile served it)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from adaptive_spec.common.lru import LRU
from adaptive_spec.sessions.drafter import SEPARATOR, DraftEstimate, NgramIndex, NgramParams, estimate_drafts


@dataclass(frozen=True, slots=True)
class TurnStats:
    """One turn of a session. Every `est_` figure is an estimate from the counterfactual drafter."""

    turn: int
    new_prompt_tokens: int
    prompt_repeat_share: float  # share of the new prompt tokens an n-gram lookup of earlier context predicted
    output_tokens: int
    est_drafted: int
    est_accepted: int
    est_accepted_share: float  # share of output tokens that accepted n-gram drafts would have produced
    est_mean_accepted_run: float
    side: bool = False  # a side request (title, commit message): recorded, not a turn, not in the averages


@dataclass(frozen=True, slots=True)
class SessionSnapshot:
    session_id: str
    project: str
    turns: int
    indexed_tokens: int
    memory_bytes: int
    est_accepted_share_ewma: float | None
    prompt_repeat_share_ewma: float | None
    last_turns: tuple[TurnStats, ...]
    last_seen: float


@dataclass
class _Session:
    project: str
    index: NgramIndex
    last_seen: float
    seen_messages: set[bytes] = field(default_factory=set)
    last_digests: list[bytes] = field(default_factory=list)
    turns: int = 0
    accepted_ewma: float | None = None
    repeat_ewma: float | None = None
    pending_prompt: tuple[int, float] = (0, 0.0)  # (new prompt tokens, repeat share) awaiting the response
    history: deque[TurnStats] = field(default_factory=deque)


_MAX_SEEN_MESSAGES = 20_000


def _ewma(old: float | None, value: float, alpha: float) -> float:
    return value if old is None else alpha * value + (1 - alpha) * old


class ContextTracker:
    """Bounded: at most `max_sessions` (least recently used dropped), `max_tokens` indexed tokens per session,
    sessions idle longer than `idle_expiry_s` dropped on the next call to `expire`."""

    def __init__(
        self,
        params: NgramParams,
        *,
        max_sessions: int = 64,
        max_tokens: int = 131_072,
        idle_expiry_s: float = 3600.0,
        ewma_alpha: float = 0.5,
        keep_turns: int = 8,
    ) -> None:
        self.params = params
        self.max_sessions, self.max_tokens = max_sessions, max_tokens
        self.idle_expiry_s, self.alpha, self.keep_turns = idle_expiry_s, ewma_alpha, keep_turns
        self._sessions: LRU[str, _Session] = LRU(max_sessions)

    def _get(self, session_id: str, project: str, now: float) -> _Session:
        session = self._sessions.get(session_id)
        if session is None:
            session = _Session(project, NgramIndex(self.params.n_match, self.max_tokens), now)
            self._sessions.put(session_id, session)
        self._sessions.touch(session_id)
        session.last_seen = now
        return session

    def plan(self, session_id: str, messages: Sequence[tuple[bytes, bool]]) -> list[int]:
        """Which of a request's messages (digest, is-assistant) are new to the session and need indexing.

        An append-only history (what most agents send) costs only what follows the previous request's messages,
        less the reply the proxy served (already indexed from the output). A rewritten history costs the
        messages whose content the session has not seen.
        """
        session = self._sessions.get(session_id)
        if session is None:
            return list(range(len(messages)))
        digests = [d for d, _ in messages]
        previous = session.last_digests
        if previous and digests[: len(previous)] == previous:
            start = len(previous)
            if session.turns:
                while start < len(messages) and messages[start][1]:
                    start += 1
            return list(range(start, len(messages)))
        return [i for i, d in enumerate(digests) if d not in session.seen_messages]

    def on_prompt(
        self,
        session_id: str,
        project: str,
        all_digests: Sequence[bytes],
        new_messages: Sequence[Sequence[int]],
        now: float,
    ) -> tuple[int, float]:
        """Index a request's new messages (their tokens, from `plan`); returns (new prompt tokens, repeat share)."""
        session = self._get(session_id, project, now)
        new_tokens = predicted = 0
        for tokens in new_messages:
            predicted += session.index.extend(tokens)
            session.index.extend((SEPARATOR,))
            new_tokens += len(tokens)
        if len(session.seen_messages) > _MAX_SEEN_MESSAGES:  # keep what the current history still refers to
            session.seen_messages = set(session.last_digests)
        session.seen_messages.update(all_digests)
        session.last_digests = list(all_digests)
        share = predicted / new_tokens if new_tokens else 0.0
        session.pending_prompt = (new_tokens, share)
        return new_tokens, share

    def on_output(
        self,
        session_id: str,
        project: str,
        reply_digest: bytes,
        output: Sequence[int],
        now: float,
        side: bool = False,
        turns: int = 1,
    ) -> TurnStats:
        """Replay a response through the counterfactual drafter and fold it into the session's statistics (a side
        request's only into its recent history: it is not a turn and moves no average)."""
        session = self._get(session_id, project, now)
        estimate: DraftEstimate = estimate_drafts(session.index, output, self.params)
        session.index.extend((SEPARATOR,))
        session.seen_messages.add(reply_digest)  # the next request carries this reply back: it is not new
        session.turns += 0 if side else turns  # turns whose updates waited together count, folded as one
        new_tokens, repeat = session.pending_prompt
        session.pending_prompt = (0, 0.0)
        turn = TurnStats(
            turn=session.turns,
            new_prompt_tokens=new_tokens,
            prompt_repeat_share=repeat,
            output_tokens=estimate.output_tokens,
            est_drafted=estimate.drafted,
            est_accepted=estimate.accepted,
            est_accepted_share=estimate.accepted_share,
            est_mean_accepted_run=estimate.mean_accepted_run,
            side=side,
        )
        session.history.append(turn)
        while len(session.history) > self.keep_turns:
            session.history.popleft()
        if side:
            return turn
        if estimate.output_tokens:
            session.accepted_ewma = _ewma(session.accepted_ewma, estimate.accepted_share, self.alpha)
        if new_tokens:
            session.repeat_ewma = _ewma(session.repeat_ewma, repeat, self.alpha)
        return turn

    def demote(self, session_id: str) -> None:
        """The session's main line starts only now: what it served so far were side requests (opencode's title
        comes before the first turn)."""
        s = self._sessions.get(session_id)
        if s is None:
            return
        s.history = deque(replace(t, side=True) for t in s.history)
        s.turns, s.accepted_ewma, s.repeat_ewma = 0, None, None

    def expire(self, now: float) -> list[str]:
        gone = [sid for sid, s in self._sessions.items() if now - s.last_seen > self.idle_expiry_s]
        for sid in gone:
            self._sessions.pop(sid)
        return gone

    def copy_state(self, session_id: str) -> tuple[int, float | None]:
        """(turns, estimated accepted-share EWMA) of a session; (0, None) for one not tracked."""
        s = self._sessions.get(session_id)
        return (s.turns, s.accepted_ewma) if s is not None else (0, None)

    def snapshot(self, session_id: str) -> SessionSnapshot | None:
        s = self._sessions.get(session_id)
        if s is None:
            return None
        return SessionSnapshot(
            session_id,
            s.project,
            s.turns,
            len(s.index),
            s.index.memory_bytes(),
            s.accepted_ewma,
            s.repeat_ewma,
            tuple(s.history),
            s.last_seen,
        )

    def snapshots(self) -> list[SessionSnapshot]:
        return [snap for sid in reversed(self._sessions) if (snap := self.snapshot(sid)) is not None]
