"""What a session's server already holds, and how many prompt tokens a new request will make it prefill.

llama-server reuses the longest token prefix its slot shares with a new prompt (`cache_n`) and prefills the rest
(`prompt_n`). The slot holds the session's previous prompt and the reply it generated. So the new tokens of a request
are those of its pieces that do not continue that prefix: the pieces (tools, system prompt, each message) are compared
by digest with the previous request's pieces followed by the served reply, up to the first that differs. Token counts
are the server's own: the previous prompt's `prompt_n + cache_n` and `predicted_n` calibrate this session's tokens per
character, so no tokenizer runs on the request path.

One record per session (`PrefixState`), bounded by an LRU: the design the proxy's per-request cost work builds on
(the digests of the previous request are the incremental fingerprints a new request is compared against). How a
prompt is read into pieces, each text hashed once, is `routing/prompt/pieces.py`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from adaptive_spec.common.lru import LRU
from adaptive_spec.routing.prompt.pieces import (
    SEEN_BYTES,
    Piece,
    PieceCache,
    SeenRequest,
    read_pieces,
    reply_digest,
    shared_chars,
)
from adaptive_spec.telemetry.records import Timings

# Tokens a chat template adds around each piece (role markers, separators) and once per prompt (the generation
# prompt, and the one token llama-server always re-evaluates): Qwen-style ChatML measured on llama-server.
PIECE_OVERHEAD_TOKENS = 5.0
PROMPT_OVERHEAD_TOKENS = 4.0
# The preamble a template writes once when tools are present ("# Tools ... <tools></tools> ... ```json"): 86 tokens
# in the template shipped for the embedded Qwen models (templates/qwen2.5-coder-tools.jinja; 85 in Qwen's own, which
# says <tool_call>), measured on llama-server; it would otherwise read as a very low characters-per-token rate.
TOOLS_OVERHEAD_TOKENS = 86.0
DEFAULT_CHARS_PER_TOKEN = 3.5
# A request's characters-per-token sample counts in full from this many characters on, and in proportion below
# (a 21-character prompt under a default system prompt says nothing about the rate of a 30,000-character one).
CALIBRATION_CHARS = 2000
_RATIO_ALPHA = 0.5
_MAX_RATIO = 3.0
# How far llama-server's cache_n may be from the held prefix the state says for a turn to teach the ratio.
_HELD_SLACK_TOKENS = 64
_HELD_SLACK = 0.05


@dataclass(frozen=True, slots=True)
class PromptEstimate:
    total_tokens: int  # the whole prompt, estimated
    shared_tokens: int  # the prefix the session's cache holds (0: nothing known)
    new_tokens: int  # what the server will prefill: total - shared
    side: bool = False  # a side request (title, commit message): another system prompt than the session's line
    line_moved: bool = False  # this request starts the main line (tools where the earlier requests had none)


@dataclass(frozen=True, slots=True)
class PrefixState:
    """A session's last served request as its server's slot holds it."""

    pieces: tuple[Piece, ...]
    reply: bytes  # digest of the served reply's text, whitespace removed
    prompt_tokens: int  # llama-server's prompt_n + cache_n for that request
    reply_tokens: int  # of its predicted_n, those the reply sent back reuses (all unless a call was respaced)
    chars_per_token: float  # this session's, from llama-server's counts
    line: bytes | None = None  # the system prompt digest of the session's main line
    line_tools: bool = False
    # The digest of the main line's tools: a request with the same tools under another system prompt is the line
    # going on (an agent that writes the workspace's state into its system prompt each run: Continue CLI's --resume),
    # and `line` stays the first one's (a changed line would read as the line starting only now).
    line_tools_digest: bytes | None = None
    # llama-server's prefilled tokens over this estimate's, on turns that continued a held prefix (EWMA): the
    # template's cost of tool calls and tool results, which characters alone miss.
    new_ratio: float = 1.0
    reply_again: int = 0  # the rest of its predicted_n: prefilled again when the reply comes back
    opening: float = 0.0  # the template's own system block ahead of its pieces (`total_tokens`), 0: none


_NO_STATE = PrefixState((), b"", 0, 0, DEFAULT_CHARS_PER_TOKEN)


def _system(pieces: Sequence[Piece], has_tools: bool) -> bytes | None:
    first = next((p for p in pieces if not p.tools), None)
    return first.digest if first is not None and not first.assistant else None


def line_of(pieces: Sequence[Piece]) -> bytes | None:
    """The digest of a prompt's system prompt: which conversation of its session it goes on (the main line, a side
    line such as a subagent's)."""
    return _system(pieces, False)


def _tools_digest(pieces: Sequence[Piece]) -> bytes | None:
    return next((p.digest for p in pieces if p.tools), None)


def _line_goes_on(state: PrefixState, pieces: Sequence[Piece]) -> bool:
    """The request has the main line's tools: its own line, whatever its system prompt says now."""
    return state.line_tools_digest is not None and _tools_digest(pieces) == state.line_tools_digest


def _markup(pieces: Sequence[Piece]) -> float:
    """The template's tokens around the pieces' texts: each piece's markers, and its tool calls' or results'."""
    return PIECE_OVERHEAD_TOKENS * len(pieces) + sum([p.extra for p in pieces])


def _tokens(pieces: Sequence[Piece], chars_per_token: float) -> float:
    return sum([p.chars for p in pieces]) / chars_per_token + _markup(pieces)


def tokens_beyond(pieces: Sequence[Piece], n: int, chars_per_token: float) -> int:
    """The tokens of a prompt after its first `n` pieces, what a restored head of those pieces leaves to prefill:
    the rest's texts and markup, and the generation prompt (the tools preamble is the head's)."""
    return max(1, round(_tokens(pieces[n:], chars_per_token) + PROMPT_OVERHEAD_TOKENS))


def _fixed(pieces: Sequence[Piece]) -> float:
    """The template's tokens a prompt has whatever its text: the generation prompt, and the tools preamble."""
    return PROMPT_OVERHEAD_TOKENS + (TOOLS_OVERHEAD_TOKENS if any(p.tools for p in pieces) else 0.0)


def _leading_same(pieces: Sequence[Piece], prev: Sequence[Piece]) -> int:
    """How many leading pieces have the same digests: one C-level comparison when the shorter list is all equal (a
    session's next turn takes its unchanged pieces whole from its last request), else digest by digest."""
    m = min(len(pieces), len(prev))
    if tuple(pieces[:m]) == tuple(prev[:m]):
        return m
    n = 0
    while n < m and pieces[n].digest == prev[n].digest:
        n += 1
    return n


def _against(
    held: PrefixState, pieces: Sequence[Piece], cpt: float, total: float, opening: float = 0.0
) -> tuple[float, float]:
    """(shared, new) tokens of a prompt against what a slot holds: `held`'s prompt, then its reply. `opening`: the
    template's own system block ahead of the pieces (`total_tokens`), held wherever a leading piece is, and wherever
    the slot's prompt opened with it too."""
    prev = held.pieces
    n = _leading_same(pieces, prev)
    if n == len(prev) and prev:
        # The whole previous prompt is held; the reply follows it in the slot when the client sent it back as it was.
        shared = float(held.prompt_tokens - 1)
        k = n
        while k < len(pieces) and pieces[k].assistant:
            k += 1
        again = 0.0
        if k > n and (held.reply_tokens or held.reply_again) and held.reply in {p.digest for p in pieces[n:k]}:
            shared += held.reply_tokens
            again = float(held.reply_again)
            n = k
        rest = pieces[n:]
        if not rest and not again:
            # All of it held (the same prompt sent again): llama-server evaluates its last token again, and only it.
            return float(held.prompt_tokens - 1), 1.0
        preamble = TOOLS_OVERHEAD_TOKENS if any(p.tools for p in rest) else 0.0
        return shared, _tokens(rest, cpt) + again + PROMPT_OVERHEAD_TOKENS + preamble
    # The first differing piece still shares its leading characters: llama-server reuses tokens up to the first one
    # that differs, wherever it falls inside a piece.
    within = shared_chars(prev[n], pieces[n]) if n < len(prev) and n < len(pieces) else 0
    shared = _tokens(pieces[:n], cpt) + within / cpt + (opening if n or within or held.opening == opening else 0.0)
    if any(p.tools for p in pieces[:n]) or (within and pieces[n].tools):
        shared += TOOLS_OVERHEAD_TOKENS  # the preamble around a held tool list is held with it
    return shared, max(1.0, total - shared)


def total_tokens(pieces: Sequence[Piece], chars_per_token: float, opening: float = 0.0) -> float:
    """The whole prompt's tokens, estimated (`estimate` and `shared_tokens` take it when the caller has it).
    `opening`: the tokens the chat template writes ahead of the pieces, its default system prompt for a chat prompt
    that has none of its own (Qwen's "You are Qwen, created by Alibaba Cloud...": 21 tokens, measured on llama-server;
    `llama/template_opening.py`)."""
    return _tokens(pieces, chars_per_token) + _fixed(pieces) + opening


def estimate(
    state: PrefixState | None,
    pieces: Sequence[Piece],
    has_tools: bool,
    chars_per_token: float,
    slot: PrefixState | None = None,
    total: float | None = None,
    opening: float = 0.0,
) -> PromptEstimate:
    """The request's prompt tokens, and how many of them a server already holds: the session's own last request
    (`state`: in its slot, or in llama-server's RAM cache of prompts) or whatever request the slot it will use served
    last (`slot`: another session of the same agent shares the system prompt and tools). `total`: `total_tokens`
    at the session's rate, when the caller has it; `opening`, as `total_tokens` takes it."""
    cpt = state.chars_per_token if state is not None else chars_per_token
    if total is None:
        total = total_tokens(pieces, cpt, opening)
    best = (0.0, total)
    for held in (state, slot):
        if held is not None:
            best = max(best, _against(held, pieces, cpt, total, opening), key=lambda c: c[0])
    shared, new = best
    if shared > 0 and new > 1:
        new = max(1.0, new * (state or slot or _NO_STATE).new_ratio)
    side = line_moved = False
    if state is not None and state.line is not None:
        system = _system(pieces, has_tools)
        line_moved = system != state.line and has_tools and not state.line_tools
        side = system != state.line and not line_moved and not _line_goes_on(state, pieces)
    return PromptEstimate(round(shared + new), round(shared), round(new), side, line_moved)


def shared_tokens(
    held: PrefixState | None,
    pieces: Sequence[Piece],
    chars_per_token: float,
    total: float | None = None,
    opening: float = 0.0,
) -> int:
    """The tokens of this prompt that a slot holding `held` would reuse (`total`: `total_tokens`, if known)."""
    if held is None:
        return 0
    if total is None:
        total = total_tokens(pieces, chars_per_token, opening)
    return round(_against(held, pieces, chars_per_token, total, opening)[0])


def observe(
    state: PrefixState | None,
    pieces: Sequence[Piece],
    has_tools: bool,
    reply_text: str,
    timings: Timings,
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN,
    *,
    reply_kept: float = 1.0,
    opening: float = 0.0,
) -> PrefixState:
    """The session's slot after a request served in full: its pieces, its reply, and llama-server's counts.
    `chars_per_token` is the rate a new session starts from (the proxy's latest); `reply_kept`, the share of the
    reply that stays reusable when it is sent back (`Completion.reply_kept`); `opening`, as `total_tokens` takes it
    (the template's tokens, not the texts')."""
    prompt_tokens = timings.prompt_n + timings.cache_n
    chars = sum(p.chars for p in pieces)
    templated = prompt_tokens - _markup(pieces) - _fixed(pieces) - opening
    cpt = state.chars_per_token if state is not None else chars_per_token
    ratio = state.new_ratio if state is not None else 1.0
    # Counts from `usage` (llama-server's Anthropic API: no timings) are its own too: prompt_n and cache_n exact.
    if state is not None and timings.cache_n > 0:
        total = total_tokens(pieces, cpt, opening)
        shared, new = _against(state, pieces, cpt, total, opening)
        # Only a turn that reused what the session's state says is held measures the template's cost: a prompt held
        # whole says nothing of it, and one the server held more or less of (its RAM cache had another of the
        # session's prompts, or a slot action overwrote it) compares other tokens.
        held_as_said = abs(shared - timings.cache_n) <= max(_HELD_SLACK_TOKENS, _HELD_SLACK * prompt_tokens)
        if shared > 0 and new > 1 and held_as_said:
            sample = timings.prompt_n / new
            ratio = min(_MAX_RATIO, max(1 / _MAX_RATIO, _RATIO_ALPHA * sample + (1 - _RATIO_ALPHA) * ratio))
    if chars > 0 and templated > 0:
        weight = min(1.0, chars / CALIBRATION_CHARS)
        cpt = weight * (chars / templated) + (1 - weight) * cpt
    system = _system(pieces, has_tools)
    line, line_tools = (state.line, state.line_tools) if state is not None else (None, False)
    line_tools_digest = state.line_tools_digest if state is not None else None
    if line is None or (has_tools and not line_tools):
        line, line_tools, line_tools_digest = system, has_tools, _tools_digest(pieces)
    return PrefixState(
        pieces=tuple(pieces),
        reply=reply_digest(reply_text),
        prompt_tokens=prompt_tokens,
        reply_tokens=round(timings.predicted_n * reply_kept),
        reply_again=timings.predicted_n - round(timings.predicted_n * reply_kept),
        chars_per_token=cpt,
        line=line,
        line_tools=line_tools,
        line_tools_digest=line_tools_digest,
        new_ratio=ratio,
        opening=opening,
    )


class PrefixTable:
    """Each session's `PrefixState` (bounded: least recently used sessions are forgotten), the pieces made for any
    session's texts (`PieceCache`), and each session's last request as its pieces were read (`SeenRequest`: bounded
    by sessions and by the bytes of the requests kept)."""

    def __init__(self, max_sessions: int = 4096, max_seen_bytes: int = SEEN_BYTES) -> None:
        self._states: LRU[str, PrefixState] = LRU(max_sessions)
        self.cache = PieceCache()
        self._seen: LRU[str, SeenRequest] = LRU(max_sessions, max_weight=max_seen_bytes, weigh=lambda s: s.weight)

    def pieces(
        self, body: Mapping[str, Any], state: PrefixState | None, session_id: str | None = None, body_bytes: int = 0
    ) -> tuple[Piece, ...]:
        """`prompt_pieces` of a request against its session's state: only texts never seen before are hashed, and
        the messages its session's last request carried too are not read at all. A request is kept for that only
        once its session has been served (`state`): a conversation of one request (a retry, a new conversation
        without an id) would only hold its body in memory."""
        seen = self._seen.get(session_id) if session_id is not None else None
        pieces, now = read_pieces(body, state.pieces if state is not None else (), self.cache, seen, body_bytes)
        if session_id is not None and state is not None:
            self._seen.put(session_id, now)
        return pieces

    def get(self, session_id: str | None) -> PrefixState | None:
        return self._states.get(session_id) if session_id is not None else None

    def put(self, session_id: str, state: PrefixState) -> None:
        self._states.put(session_id, state)
