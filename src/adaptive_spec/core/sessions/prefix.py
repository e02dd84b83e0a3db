"""What a session's server already holds, and how many prompt tokens a new request will make it prefill.

llama-server reuses the longest token prefix its slot shares with a new prompt (`cache_n`) and prefills the rest
(`prompt_n`). The slot holds the session's previous prompt and the reply it generated. So the new tokens of a request
are those of its pieces that do not continue that prefix: the pieces (tools, system prompt, each message) are compared
by digest with the previous request's pieces followed by the served reply, up to the first that differs. Token counts
are the server's own: the previous prompt's `prompt_n + cache_n` and `predicted_n` calibrate this session's tokens per
character, so no tokenizer runs on the request path.

One record per session (`PrefixState`), bounded by an LRU: the design the proxy's per-request cost work builds on
(the digests of the previous request are the incremental fingerprints a new request is compared against).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from adaptive_spec.core.lru import LRU
from adaptive_spec.core.records import Timings
from adaptive_spec.core.sessions.grouping import context_texts, message_digest, message_key

# Tokens a chat template adds around each piece (role markers, separators) and once per prompt (the generation
# prompt, and the one token llama-server always re-evaluates): Qwen-style ChatML measured on llama-server.
PIECE_OVERHEAD_TOKENS = 5.0
PROMPT_OVERHEAD_TOKENS = 4.0
DEFAULT_CHARS_PER_TOKEN = 3.5
_RATIO_ALPHA = 0.5
_MAX_RATIO = 3.0


@dataclass(frozen=True, slots=True)
class Piece:
    """One piece of a prompt: the tools, the system prompt or one message, as the template renders them in order."""

    digest: bytes
    chars: int
    assistant: bool = False
    tools: bool = False
    # `message_key` of the piece's role and text (0: none): a later request's piece with the same key and length
    # takes this digest instead of hashing its text again. Process-local, so not part of a piece's identity.
    key: int = field(default=0, compare=False)


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
    reply_tokens: int  # its predicted_n
    chars_per_token: float  # this session's, from llama-server's counts
    line: bytes | None = None  # the system prompt digest of the session's main line
    line_tools: bool = False
    # llama-server's prefilled tokens over this estimate's, on turns that continued a held prefix (EWMA): the
    # template's cost of tool calls and tool results, which characters alone miss.
    new_ratio: float = 1.0


_NO_STATE = PrefixState((), b"", 0, 0, DEFAULT_CHARS_PER_TOKEN)


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=12).digest()


def reply_digest(text: str) -> bytes:
    """The digest an assistant message carrying exactly this text has among a request's pieces."""
    return message_digest("assistant", text)


def prompt_pieces(body: Mapping[str, Any], known: Sequence[Piece] = ()) -> tuple[Piece, ...]:
    """The pieces of a generating request, in the order a chat template renders them (tools go into the system
    block). A plain `prompt` (completions) is one piece.

    `known`: the session's previous pieces. A message whose role, text length and `message_key` match one of them
    takes its digest: a turn hashes only its new messages (the key still reads each text once, ~10x faster).
    """
    pieces: list[Piece] = []
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        pieces.append(Piece(_digest(b"prompt\0" + prompt.encode("utf-8", "surrogatepass")), len(prompt)))
    digests = {(p.key, p.chars): p.digest for p in known if p.key}
    for role, assistant, text in context_texts(body):
        key = message_key(role, text)
        digest = digests.get((key, len(text))) or message_digest(role, text)
        pieces.append(Piece(digest, len(text), assistant, key=key))
    tools = body.get("tools")
    if tools:
        # Chat templates put the tools at the end of the system block: after the system prompt, before the rest.
        raw = orjson.dumps(tools)
        at = 1 if _starts_with_system(body) and pieces else 0
        pieces.insert(at, Piece(_digest(b"tools\0" + raw), len(raw), tools=True))
    return tuple(pieces)


def _starts_with_system(body: Mapping[str, Any]) -> bool:
    if body.get("instructions") or body.get("system"):
        return True
    messages = body.get("messages") or body.get("input")
    first = messages[0] if isinstance(messages, list) and messages else None
    return isinstance(first, dict) and first.get("role") in ("system", "developer")


def _system(pieces: Sequence[Piece], has_tools: bool) -> bytes | None:
    first = next((p for p in pieces if not p.tools), None)
    return first.digest if first is not None and not first.assistant else None


def _tokens(chars: int, pieces: int, chars_per_token: float) -> float:
    return chars / chars_per_token + pieces * PIECE_OVERHEAD_TOKENS


def _against(held: PrefixState, pieces: Sequence[Piece], cpt: float, total: float) -> tuple[float, float]:
    """(shared, new) tokens of a prompt against what a slot holds: `held`'s prompt, then its reply."""
    prev = held.pieces
    n = 0
    while n < len(pieces) and n < len(prev) and pieces[n].digest == prev[n].digest:
        n += 1
    if n == len(prev) and prev:
        # The whole previous prompt is held; the reply follows it in the slot when the client sent it back as it was.
        shared = float(held.prompt_tokens - 1)
        k = n
        while k < len(pieces) and pieces[k].assistant:
            k += 1
        if k > n and held.reply_tokens and held.reply in {p.digest for p in pieces[n:k]}:
            shared += held.reply_tokens
            n = k
        rest = pieces[n:]
        return shared, _tokens(sum(p.chars for p in rest), len(rest), cpt) + PROMPT_OVERHEAD_TOKENS
    shared = _tokens(sum(p.chars for p in pieces[:n]), n, cpt)
    return shared, max(1.0, total - shared)


def estimate(
    state: PrefixState | None,
    pieces: Sequence[Piece],
    has_tools: bool,
    chars_per_token: float,
    slot: PrefixState | None = None,
) -> PromptEstimate:
    """The request's prompt tokens, and how many of them a server already holds: the session's own last request
    (`state`: in its slot, or in llama-server's RAM cache of prompts) or whatever request the slot it will use served
    last (`slot`: another session of the same agent shares the system prompt and tools)."""
    cpt = state.chars_per_token if state is not None else chars_per_token
    total = _tokens(sum(p.chars for p in pieces), len(pieces), cpt) + PROMPT_OVERHEAD_TOKENS
    best = (0.0, total)
    for held in (state, slot):
        if held is not None:
            best = max(best, _against(held, pieces, cpt, total), key=lambda c: c[0])
    shared, new = best
    if shared > 0:
        new *= (state or slot or _NO_STATE).new_ratio
    side = line_moved = False
    if state is not None and state.line is not None:
        system = _system(pieces, has_tools)
        line_moved = system != state.line and has_tools and not state.line_tools
        side = system != state.line and not line_moved
    return PromptEstimate(round(shared + new), round(shared), round(new), side, line_moved)


def shared_tokens(held: PrefixState | None, pieces: Sequence[Piece], chars_per_token: float) -> int:
    """The tokens of this prompt that a slot holding `held` would reuse."""
    if held is None:
        return 0
    total = _tokens(sum(p.chars for p in pieces), len(pieces), chars_per_token) + PROMPT_OVERHEAD_TOKENS
    return round(_against(held, pieces, chars_per_token, total)[0])


def observe(
    state: PrefixState | None,
    pieces: Sequence[Piece],
    has_tools: bool,
    reply_text: str,
    timings: Timings,
) -> PrefixState:
    """The session's slot after a request served in full: its pieces, its reply, and llama-server's counts."""
    prompt_tokens = timings.prompt_n + timings.cache_n
    chars = sum(p.chars for p in pieces)
    templated = prompt_tokens - len(pieces) * PIECE_OVERHEAD_TOKENS - PROMPT_OVERHEAD_TOKENS
    cpt = state.chars_per_token if state is not None else DEFAULT_CHARS_PER_TOKEN
    ratio = state.new_ratio if state is not None else 1.0
    if state is not None and timings.cache_n > 0 and not timings.from_usage:
        total = _tokens(chars, len(pieces), cpt) + PROMPT_OVERHEAD_TOKENS
        shared, new = _against(state, pieces, cpt, total)
        if shared > 0 and new > 0:
            sample = timings.prompt_n / new
            ratio = min(_MAX_RATIO, max(1 / _MAX_RATIO, _RATIO_ALPHA * sample + (1 - _RATIO_ALPHA) * ratio))
    if chars > 0 and templated > 0:
        cpt = chars / templated
    system = _system(pieces, has_tools)
    line, line_tools = (state.line, state.line_tools) if state is not None else (None, False)
    if line is None or (has_tools and not line_tools):
        line, line_tools = system, has_tools
    return PrefixState(
        pieces=tuple(pieces),
        reply=reply_digest(reply_text),
        prompt_tokens=prompt_tokens,
        reply_tokens=timings.predicted_n,
        chars_per_token=cpt,
        line=line,
        line_tools=line_tools,
        new_ratio=ratio,
    )


class PrefixTable:
    """Each session's `PrefixState` (bounded: least recently used sessions are forgotten)."""

    def __init__(self, max_sessions: int = 4096) -> None:
        self._states: LRU[str, PrefixState] = LRU(max_sessions)

    def get(self, session_id: str | None) -> PrefixState | None:
        return self._states.get(session_id) if session_id is not None else None

    def put(self, session_id: str, state: PrefixState) -> None:
        self._states.put(session_id, state)
