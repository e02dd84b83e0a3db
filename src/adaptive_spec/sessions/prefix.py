"""What a session's server already holds, and how many prompt tokens a new request will make it prefill.

llama-server reuses the longest token prefix its slot shares with a new prompt (`cache_n`) and prefills the rest
(`prompt_n`). The slot holds the session's previous prompt and the reply it generated. So the new tokens of a request
are those of its pieces that do not continue that prefix: the pieces (tools, system prompt, each message) are compared
by digest with the previous request's pieces followed by the served reply, up to the first that differs. Token counts
are the server's own: the previous prompt's `prompt_n + cache_n` and `predicted_n` calibrate this session's tokens per
character, so no tokenizer runs on the request path.

One record per session (`PrefixState`), bounded by an LRU: the design the proxy's per-request cost work builds on
(the digests of the previous request are the incremental fingerprints a new request is compared against). A text is
hashed once: a session's next turn takes its unchanged pieces from its state, and any request takes a piece made for
the same text before, in any session (`PieceCache`: a conversation's first request, another session's system prompt).
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from adaptive_spec.common.lru import LRU
from adaptive_spec.sessions.grouping import message_digest, message_entry, message_key, messages_of, system_entries
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
# What a template writes around each tool call beyond a message's markers and the call's text (`call_text`,
# `{"name": …, "arguments": …}`): the fence of the shipped template's json block, one token more than Qwen's own
# `<tool_call>…</tool_call>`, and what characters alone miss of the call's JSON; and around each tool result
# (`<tool_response>…</tool_response>`). Measured on llama-server with opencode's and Codex CLI's recorded turns
# (40-45 tokens per call and result; 26 for a call when its text was its arguments alone).
TOOL_CALL_TOKENS = 16.0
TOOL_RESULT_TOKENS = 15.0
# A request's characters-per-token sample counts in full from this many characters on, and in proportion below
# (a 21-character prompt under a default system prompt says nothing about the rate of a 30,000-character one).
CALIBRATION_CHARS = 2000
_RATIO_ALPHA = 0.5
_MAX_RATIO = 3.0
# A piece's text is also keyed in chained blocks of this many characters, so two pieces that differ only near
# their end (a tool list with one changed description, a system prompt with today's date last) are known to share
# the characters before the first differing block. 8 bytes per block: ~3% of the text's size kept per session.
BLOCK_CHARS = 256
_BLOCK_DIGEST = 8
# Pieces kept for texts seen before, whichever session's (`PieceCache`), and the bytes of their block keys at most.
_CACHED_PIECES = 16_384
_CACHED_BLOCK_BYTES = 16 * 1024 * 1024
# The request bodies kept to compare a session's next request with (`SeenRequest`), in bytes at most: ~130 sessions
# of a 120k-token history, thousands of short ones.
_SEEN_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Piece:
    """One piece of a prompt: the tools, the system prompt or one message, as the template renders them in order."""

    digest: bytes
    chars: int
    assistant: bool = False
    tools: bool = False
    blocks: bytes = b""  # chained digests of each whole BLOCK_CHARS block of the text, _BLOCK_DIGEST bytes each
    extra: float = 0.0  # the template's tokens around its tool calls or tool results, beyond PIECE_OVERHEAD_TOKENS
    # `message_key` of the piece's role and text (0: none): a later request's piece with the same key and length
    # takes this digest and these blocks instead of hashing its text again. Process-local, so not part of a piece's
    # identity.
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


def _blocks(kind: str, text: str) -> bytes:
    """Chained keys of the text's whole blocks: block i's key covers everything up to its end (and the kind), so the
    number of leading equal keys of two pieces is the number of leading blocks they share. Python's keyed hashes,
    64 bits a block, ~4x cheaper than a digest: process-local, as the prefix states that keep them are."""
    blocks = (text[at - BLOCK_CHARS : at] for at in range(BLOCK_CHARS, len(text) + 1, BLOCK_CHARS))
    chain = itertools.accumulate(blocks, _chained, initial=hash(kind))
    return array("q", itertools.islice(chain, 1, None)).tobytes()


def _chained(previous: int, block: str) -> int:
    return hash((previous, block))


def _shared_chars(a: Piece, b: Piece) -> int:
    """The characters two differing pieces are known to share at their start (whole blocks only)."""
    n = 0
    limit = min(len(a.blocks), len(b.blocks))
    while n < limit and a.blocks[n : n + _BLOCK_DIGEST] == b.blocks[n : n + _BLOCK_DIGEST]:
        n += _BLOCK_DIGEST
    return n // _BLOCK_DIGEST * BLOCK_CHARS


def reply_digest(text: str) -> bytes:
    """The digest an assistant message carrying exactly this text has among a request's pieces."""
    return message_digest("assistant", text)


class PieceCache:
    """Pieces by their text's key and length, whichever session's prompt they were made for: a request carrying a
    text seen before takes its digest and blocks instead of hashing the text again. Bounded by pieces and by the
    bytes of their block keys."""

    def __init__(self, max_pieces: int = _CACHED_PIECES, max_block_bytes: int = _CACHED_BLOCK_BYTES) -> None:
        self._pieces: LRU[tuple[int, int, bool], Piece] = LRU(
            max_pieces, max_weight=max_block_bytes, weigh=lambda piece: len(piece.blocks)
        )

    def get(self, key: int, chars: int, tools: bool = False) -> Piece | None:
        return self._pieces.get((key, chars, tools))

    def put(self, piece: Piece) -> None:
        self._pieces.put((piece.key, piece.chars, piece.tools), piece)


def prompt_pieces(
    body: Mapping[str, Any], known: Sequence[Piece] = (), cache: PieceCache | None = None
) -> tuple[Piece, ...]:
    """The pieces of a generating request, in the order a chat template renders them (tools go into the system
    block). A plain `prompt` (completions) is one piece.

    `known`: the session's previous pieces. A message whose role, text length and `message_key` match one of them
    takes its digest: a turn hashes only its new messages (the key still reads each text once, ~10x faster).
    `cache`: pieces made before for any session, looked up the same way when `known` has none; the pieces hashed
    here are added to it.
    """
    return _read(body, known, cache, None, 0)[0]


@dataclass(frozen=True, slots=True)
class SeenRequest:
    """A session's last request as its pieces were read: its messages and theirs, its tools and theirs. The next
    request's messages are compared with these (equal dicts, compared in C: a memcmp of each text, no hash) and the
    pieces of those that are equal taken as they are, so a turn reads only its new messages."""

    messages: tuple[Any, ...]
    pieces: tuple[Piece, ...]  # one per message
    tools: list[Any]
    tools_piece: Piece | None
    weight: int  # what keeping it holds: the request body's bytes


def _read(
    body: Mapping[str, Any],
    known: Sequence[Piece],
    cache: PieceCache | None,
    seen: SeenRequest | None,
    weight: int,
) -> tuple[tuple[Piece, ...], SeenRequest]:
    """`prompt_pieces`, and the request as seen (for the session's next request, `seen` being this one's)."""
    pieces: list[Piece] = []
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        raw = prompt.encode("utf-8", "surrogatepass")
        pieces.append(Piece(_digest(b"prompt\0" + raw), len(prompt), blocks=_blocks("prompt", prompt)))
    known_by = _KnownPieces(known)
    for role, assistant, text, _ in system_entries(body):
        pieces.append(_piece(role, assistant, text, 0.0, known_by, cache))
    messages = messages_of(body)
    same = 0
    if seen is not None:
        for new, old in zip(messages, seen.messages, strict=False):  # the shorter ends the comparison
            if new is not old and new != old:
                break
            same += 1
    of_messages = list(seen.pieces[:same]) if seen is not None else []
    for message in messages[same:]:
        role, assistant, text, _ = message_entry(message)
        of_messages.append(_piece(role, assistant, text, _tool_template_tokens(message), known_by, cache))
    pieces += of_messages
    tools = _rendered_tools(body.get("tools"))
    tools_piece = None
    if tools:
        tools_piece = seen.tools_piece if seen is not None and seen.tools == tools else None
        tools_piece = tools_piece or _tools_piece(tools, known, cache)
        # Chat templates put the tools at the end of the system block: after the system prompt, before the rest.
        at = 1 if _starts_with_system(body) and pieces else 0
        pieces.insert(at, tools_piece)
    return tuple(pieces), SeenRequest(tuple(messages), tuple(of_messages), tools, tools_piece, weight)


def _piece(
    role: str,
    assistant: bool,
    text: str,
    extra: float,
    known_by: _KnownPieces,
    cache: PieceCache | None,
) -> Piece:
    """A message's piece: the one made before for the same text when there is one, else hashed now."""
    key = message_key(role, text)
    old = known_by.get((key, len(text)))
    if old is None and cache is not None:
        old = cache.get(key, len(text))
    if old is not None and old.assistant == assistant and old.extra == extra and not old.tools:
        return old  # the same message as last turn (or as another request's): its piece as it was
    if old is not None:
        digest, blocks = old.digest, old.blocks
    else:
        digest, blocks = message_digest(role, text), _blocks(str(assistant), text)
    piece = Piece(digest, len(text), assistant, blocks=blocks, extra=extra, key=key)
    if cache is not None:
        cache.put(piece)
    return piece


class _KnownPieces:
    """The session's previous pieces by key and length, indexed only when a message is read (most turns read one
    or two: the rest are taken whole from the session's last request)."""

    __slots__ = ("_by", "_known")

    def __init__(self, known: Sequence[Piece]) -> None:
        self._known = known
        self._by: dict[tuple[int, int], Piece] | None = None

    def get(self, key: tuple[int, int]) -> Piece | None:
        if self._by is None:
            self._by = {(p.key, p.chars): p for p in self._known if p.key}
        return self._by.get(key)


def _tools_piece(tools: list[Any], known: Sequence[Piece], cache: PieceCache | None) -> Piece:
    raw = orjson.dumps(tools)
    key = hash(raw)  # with the length, tells the tools of last turn without hashing them again
    old = next((p for p in known if p.tools and p.key == key and p.chars == len(raw)), None)
    if old is None and cache is not None:
        old = cache.get(key, len(raw), tools=True)
    if old is None:
        old = Piece(_digest(b"tools\0" + raw), len(raw), tools=True, blocks=_blocks("tools", raw.decode()), key=key)
        if cache is not None:
            cache.put(old)
    return old


def _tool_template_tokens(message: Mapping[str, Any]) -> float:
    """The template's tokens around a message's tool calls and tool results (chat, Responses and Anthropic shapes)."""
    kind = message.get("type") or message.get("role")
    if kind in ("function_call", "custom_tool_call"):
        return TOOL_CALL_TOKENS
    if kind in ("tool", "function_call_output", "custom_tool_call_output"):
        return TOOL_RESULT_TOKENS
    calls = message.get("tool_calls")
    tokens = TOOL_CALL_TOKENS * len(calls) if isinstance(calls, list) else 0.0
    content = message.get("content")
    for block in content if isinstance(content, list) else ():
        if isinstance(block, dict) and block.get("type") == "tool_use":
            tokens += TOOL_CALL_TOKENS
        elif isinstance(block, dict) and block.get("type") == "tool_result":
            tokens += TOOL_RESULT_TOKENS
    return tokens


def _rendered_tools(tools: Any) -> list[Any]:
    """The tools a template renders: llama-server skips Responses-API tools that are not functions (Codex sends a
    `namespace` of 11,000 characters and `web_search`); entries without a type (Anthropic's) are kept."""
    if not isinstance(tools, list):
        return []
    return [t for t in tools if not isinstance(t, dict) or t.get("type") in (None, "function")]


def _starts_with_system(body: Mapping[str, Any]) -> bool:
    if body.get("instructions") or body.get("system"):
        return True
    messages = body.get("messages") or body.get("input")
    first = messages[0] if isinstance(messages, list) and messages else None
    return isinstance(first, dict) and first.get("role") in ("system", "developer")


def _system(pieces: Sequence[Piece], has_tools: bool) -> bytes | None:
    first = next((p for p in pieces if not p.tools), None)
    return first.digest if first is not None and not first.assistant else None


def _markup(pieces: Sequence[Piece]) -> float:
    """The template's tokens around the pieces' texts: each piece's markers, and its tool calls' or results'."""
    return sum(PIECE_OVERHEAD_TOKENS + p.extra for p in pieces)


def _tokens(pieces: Sequence[Piece], chars_per_token: float) -> float:
    return sum(p.chars for p in pieces) / chars_per_token + _markup(pieces)


def _fixed(pieces: Sequence[Piece]) -> float:
    """The template's tokens a prompt has whatever its text: the generation prompt, and the tools preamble."""
    return PROMPT_OVERHEAD_TOKENS + (TOOLS_OVERHEAD_TOKENS if any(p.tools for p in pieces) else 0.0)


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
        preamble = TOOLS_OVERHEAD_TOKENS if any(p.tools for p in rest) else 0.0
        return shared, _tokens(rest, cpt) + PROMPT_OVERHEAD_TOKENS + preamble
    # The first differing piece still shares its leading characters: llama-server reuses tokens up to the first one
    # that differs, wherever it falls inside a piece.
    within = _shared_chars(prev[n], pieces[n]) if n < len(prev) and n < len(pieces) else 0
    shared = _tokens(pieces[:n], cpt) + within / cpt
    if any(p.tools for p in pieces[:n]) or (within and pieces[n].tools):
        shared += TOOLS_OVERHEAD_TOKENS  # the preamble around a held tool list is held with it
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
    total = _tokens(pieces, cpt) + _fixed(pieces)
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
    total = _tokens(pieces, chars_per_token) + _fixed(pieces)
    return round(_against(held, pieces, chars_per_token, total)[0])


def observe(
    state: PrefixState | None,
    pieces: Sequence[Piece],
    has_tools: bool,
    reply_text: str,
    timings: Timings,
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN,
) -> PrefixState:
    """The session's slot after a request served in full: its pieces, its reply, and llama-server's counts.
    `chars_per_token` is the rate a new session starts from (the proxy's latest)."""
    prompt_tokens = timings.prompt_n + timings.cache_n
    chars = sum(p.chars for p in pieces)
    templated = prompt_tokens - _markup(pieces) - _fixed(pieces)
    cpt = state.chars_per_token if state is not None else chars_per_token
    ratio = state.new_ratio if state is not None else 1.0
    if state is not None and timings.cache_n > 0 and not timings.from_usage:
        total = _tokens(pieces, cpt) + _fixed(pieces)
        shared, new = _against(state, pieces, cpt, total)
        if shared > 0 and new > 0:
            sample = timings.prompt_n / new
            ratio = min(_MAX_RATIO, max(1 / _MAX_RATIO, _RATIO_ALPHA * sample + (1 - _RATIO_ALPHA) * ratio))
    if chars > 0 and templated > 0:
        weight = min(1.0, chars / CALIBRATION_CHARS)
        cpt = weight * (chars / templated) + (1 - weight) * cpt
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
    """Each session's `PrefixState` (bounded: least recently used sessions are forgotten), the pieces made for any
    session's texts (`PieceCache`), and each session's last request as its pieces were read (`SeenRequest`: bounded
    by sessions and by the bytes of the requests kept)."""

    def __init__(self, max_sessions: int = 4096, max_seen_bytes: int = _SEEN_BYTES) -> None:
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
        pieces, now = _read(body, state.pieces if state is not None else (), self.cache, seen, body_bytes)
        if session_id is not None and state is not None:
            self._seen.put(session_id, now)
        return pieces

    def get(self, session_id: str | None) -> PrefixState | None:
        return self._states.get(session_id) if session_id is not None else None

    def put(self, session_id: str, state: PrefixState) -> None:
        self._states.put(session_id, state)
