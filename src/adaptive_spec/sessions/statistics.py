"""Per-session repeated-context statistics: how much of each new prompt repeats earlier context, and what an
n-gram drafter would have made of each response (a counterfactual estimate, whichever profile served it).

The session's token stream is its messages in order, each in the chat template's framing, as llama-server's n-gram
drafter sees its prompt: a draft runs on from one message into the next. An agent's cycle of a tool call and its
result is often shorter than a draft (~40 tokens of text against ngram-mod's 48-token minimum); it repeats whole, and
is drafted, only with the framing that joins it to the next.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from adaptive_spec.common.lru import LRU
from adaptive_spec.sessions.ngram_replay import SEPARATOR, DraftEstimate, NgramIndex, NgramParams, estimate_drafts


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
# A new session's first prompt from this many tokens on is kept as an opening (indexed ~30x slower than copied).
_OPENING_MIN_TOKENS = 4096


@dataclass(frozen=True, slots=True)
class _Opening:
    """A new session's first prompt as it was indexed: where a later new session whose history starts with the same
    messages starts from, instead of indexing them again (a request sent again without a session id, a conversation
    resumed or forked: each a new session with the same long history). "The same" as the pick compares messages
    within a session: by digest, which ignores whitespace."""

    digests: tuple[bytes, ...]
    index: NgramIndex  # a copy, never extended: each session that starts from it gets its own copy
    new_tokens: int
    predicted: int


# The framing, as stand-in tokens (negative: no tokenizer makes them), as many and in the order of the tokens of
# the Qwen templates (ChatML; the shipped ones fence a tool call as a json block) on llama-server's own tokenizer:
# "<|im_start|>role\n" ... "<|im_end|>\n"; a tool's result "<|im_start|>user\n<tool_response>\n" ...
# "\n</tool_response><|im_end|>\n"; a message of tool calls "<|im_start|>assistant\n```json\n" ...
# "\n```<|im_end|>\n". Other templates differ in their exact tokens; what an n-gram table needs is framing that is
# the same each time and about as long as the real one (a draft runs out where the stream does: at the end of it).
_START, _END, _NL, _LT, _LT_SLASH, _GT, _GT_NL, _TOOL, _RESPONSE, _FENCE, _JSON = range(-2, -13, -1)
_ROLES = {"system": -20, "developer": -20, "user": -21, "assistant": -22}
_RESULTS = frozenset(("tool", "function", "function_call_output", "custom_tool_call_output"))
_CALLS = frozenset(("calls", "function_call", "custom_tool_call"))  # "calls": an assistant message of tool calls


def opening(role: str) -> tuple[int, ...]:
    """The framing before a message of this role (chat roles, a Responses-API item's type, or "calls")."""
    if role in _RESULTS:
        return (_START, _ROLES["user"], _NL, _LT, _TOOL, _RESPONSE, _GT_NL)
    if role in _CALLS:
        return (_START, _ROLES["assistant"], _NL, _FENCE, _JSON, _NL)
    return (_START, _ROLES.get(role, _ROLES["user"]), _NL)


def closing(role: str) -> tuple[int, ...]:
    if role in _RESULTS:
        return (_NL, _LT_SLASH, _TOOL, _RESPONSE, _GT, _END, _NL)
    if role in _CALLS:
        return (_NL, _FENCE, _END, _NL)
    return (_END, _NL)


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
        opening_tokens: int | None = None,
    ) -> None:
        """`opening_tokens`: the openings' bound, in indexed tokens (~80 bytes each); two full sessions' worth when
        not given; 0: none kept."""
        self.params = params
        self.max_sessions, self.max_tokens = max_sessions, max_tokens
        self.idle_expiry_s, self.alpha, self.keep_turns = idle_expiry_s, ewma_alpha, keep_turns
        self.opening_tokens = 2 * max_tokens if opening_tokens is None else opening_tokens
        self._sessions: LRU[str, _Session] = LRU(max_sessions)
        self._openings: LRU[tuple[bytes, ...], _Opening] = LRU(
            64, max_weight=max(1, self.opening_tokens), weigh=lambda o: max(1, len(o.index))
        )
        self._starts: LRU[str, _Opening] = LRU(64)  # a new session's picked opening, until its prompt is indexed

    def _get(self, session_id: str, project: str, now: float) -> _Session:
        session = self._sessions.get(session_id)
        if session is None:
            session = _Session(project, NgramIndex(self.params.n_match, self.max_tokens), now)
            self._sessions.put(session_id, session)
        self._sessions.touch(session_id)
        session.last_seen = now
        return session

    def pick(self, session_id: str, messages: Sequence[tuple[bytes, bool]]) -> list[int]:
        """Which of a request's messages (digest, is-assistant) are new to the session and need indexing.

        An append-only history (what most agents send) costs only what follows the previous request's messages,
        less the reply the proxy served (already indexed from the output). A rewritten history costs the
        messages whose content the session has not seen.
        """
        session = self._sessions.get(session_id)
        digests = [d for d, _ in messages]
        self._starts.pop(session_id)  # a pick whose prompt was never indexed (its update failed) is void
        if session is None:
            found = self._opening_for(digests)
            if found is None:
                return list(range(len(messages)))
            self._starts.put(session_id, found)
            return list(range(len(found.digests), len(messages)))
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
        roles: Sequence[str] = (),
    ) -> tuple[int, float]:
        """Index a request's new messages (their tokens, from `pick`, and their roles: "user" where not given);
        returns (new prompt tokens, repeat share). The framing counts in neither."""
        fresh = session_id not in self._sessions
        session = self._get(session_id, project, now)
        start = self._starts.pop(session_id)
        new_tokens = predicted = skipped = 0
        if (
            fresh
            and start is not None
            and len(new_messages) == len(all_digests) - len(start.digests)
            and tuple(all_digests[: len(start.digests)]) == start.digests
        ):
            # The pick left the opening's messages out: the session starts where indexing them ended.
            session.index, session.last_digests = start.index.copy(), list(start.digests)
            new_tokens, predicted, skipped = start.new_tokens, start.predicted, len(start.digests)
            self._openings.touch(start.digests)
        previous, index = session.last_digests, session.index
        if previous and list(all_digests[: len(previous)]) != previous:
            index.extend((SEPARATOR,))  # a history rewritten: its new messages do not follow the last reply
        for i, tokens in enumerate(new_messages):
            role = roles[i] if i < len(roles) else "user"
            index.extend(opening(role))
            predicted += index.extend(tokens)
            index.extend(closing(role))
            new_tokens += len(tokens)
        if len(session.seen_messages) > _MAX_SEEN_MESSAGES:  # keep what the current history still refers to
            session.seen_messages = set(session.last_digests)
        session.seen_messages.update(all_digests)
        session.last_digests = list(all_digests)
        share = predicted / new_tokens if new_tokens else 0.0
        session.pending_prompt = (new_tokens, share)
        whole = bool(all_digests) and skipped + len(new_messages) == len(all_digests)  # every message indexed here
        if fresh and whole and self.opening_tokens > 0 and new_tokens >= _OPENING_MIN_TOKENS:
            key = tuple(all_digests)
            if key not in self._openings:
                self._openings.put(key, _Opening(key, index.copy(), new_tokens, predicted))
        return new_tokens, share

    def _opening_for(self, digests: Sequence[bytes]) -> _Opening | None:
        """The longest opening whose messages begin `digests`."""
        best: _Opening | None = None
        for opening_ in self._openings.values():
            n = len(opening_.digests)
            if n <= len(digests) and (best is None or n > len(best.digests)) and tuple(digests[:n]) == opening_.digests:
                best = opening_
        return best

    def on_output(
        self,
        session_id: str,
        project: str,
        reply_digest: bytes,
        output: Sequence[int],
        now: float,
        side: bool = False,
        turns: int = 1,
        calls: bool = False,
    ) -> TurnStats:
        """Replay a response through the counterfactual drafter and fold it into the session's statistics (a side
        request's only into its recent history: it is not a turn and moves no average). `calls`: the response is
        tool calls (framed as the template frames them)."""
        session = self._get(session_id, project, now)
        role = "calls" if calls else "assistant"
        session.index.extend(opening(role))
        estimate: DraftEstimate = estimate_drafts(session.index, output, self.params)
        session.index.extend(closing(role))
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
