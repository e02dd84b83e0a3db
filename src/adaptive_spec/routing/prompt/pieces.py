"""A prompt read as the pieces a chat template renders (the tools, the system prompt, each message), each with its
digest and the chained keys of its blocks: what a session's prefix state compares a new request with
(`routing/prompt/prefix.py`).

A text is hashed once: a session's next turn takes its unchanged messages' pieces whole from its last request
(`SeenRequest`), and any request takes a piece made for the same text before, in any session (`PieceCache`: a
conversation's first request, another session's system prompt)."""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from adaptive_spec.common.lru import LRU
from adaptive_spec.sessions.messages import (
    message_digest,
    message_entry,
    message_key,
    messages_of,
    same_start,
    system_entries,
)

# What a template writes around each tool call beyond a message's markers and the call's text (`call_text`,
# `{"name": …, "arguments": …}`): the fence of the shipped template's json block, one token more than Qwen's own
# `<tool_call>…</tool_call>`, and what characters alone miss of the call's JSON; and around each tool result
# (`<tool_response>…</tool_response>`). Measured on llama-server with opencode's and Codex CLI's recorded turns
# (40-45 tokens per call and result; 26 for a call when its text was its arguments alone).
TOOL_CALL_TOKENS = 16.0
TOOL_RESULT_TOKENS = 15.0
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
SEEN_BYTES = 64 * 1024 * 1024


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


def shared_chars(a: Piece, b: Piece) -> int:
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
    return read_pieces(body, known, cache, None, 0)[0]


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


def read_pieces(
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
    same = same_start(messages, seen.messages) if seen is not None else 0
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
        blocks = _blocks("tools", raw.decode())
        old = Piece(
            _digest(b"tools\0" + raw), len(raw), tools=True, blocks=blocks, extra=_tojson_spaces(tools), key=key
        )
        if cache is not None:
            cache.put(old)
    return old


def _tojson_spaces(tools: list[Any]) -> float:
    """The tokens a template's `tojson` adds to the tools' compact JSON (the text counted): a space after every `:`
    and `,` between items, each about one token (measured on llama-server with the tools of opencode, Codex CLI and
    Cline: 0.90-1.01 a space; Cline's 25 tools, 803 tokens: its first turn estimated 15% low without them). One tool
    a line, so the list's own commas add none."""
    spaces, stack = 0, [t for t in tools if isinstance(t, dict | list)]
    while stack:
        node = stack.pop()
        items = list(node.values()) if isinstance(node, dict) else node
        spaces += (2 * len(node) - 1 if isinstance(node, dict) else len(node) - 1) if node else 0
        stack.extend(v for v in items if isinstance(v, dict | list))
    return float(spaces)


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


def prompt_texts(body: Mapping[str, Any]) -> list[str]:
    """The texts whose characters a prompt's pieces count (`read_pieces`): a count of their tokens with the model's
    own tokenizer turns those characters into tokens at this prompt's true rate."""
    texts: list[str] = []
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        texts.append(prompt)
    texts += [text for _, _, text, _ in system_entries(body)]
    texts += [message_entry(message)[2] for message in messages_of(body)]
    tools = _rendered_tools(body.get("tools"))
    if tools:
        texts.append(orjson.dumps(tools).decode("utf-8", "surrogatepass"))
    return [text for text in texts if text]


def piece_texts(body: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Each piece's kind and text, in `read_pieces`' order (a plain prompt, the system entries, the messages, the
    tools after the system prompt): what a head's persistent block digests are made of
    (`kv/heads/matching.text_blocks`). Read only for a session's first request, where a head is restored or saved."""
    texts: list[tuple[str, str]] = []
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        texts.append(("prompt", prompt))
    texts += [(role, text) for role, _, text, _ in system_entries(body)]
    for message in messages_of(body):
        role, _, text, _ = message_entry(message)
        texts.append((role, text))
    tools = _rendered_tools(body.get("tools"))
    if tools:
        at = 1 if _starts_with_system(body) and texts else 0
        texts.insert(at, ("tools", orjson.dumps(tools).decode("utf-8", "surrogatepass")))
    return texts


def _rendered_tools(tools: Any) -> list[Any]:
    """The tools a template renders: llama-server skips Responses-API tools that are not functions (Codex sends a
    `namespace` of 11,000 characters and `web_search`); entries without a type (Anthropic's) are kept."""
    if not isinstance(tools, list):
        return []
    return [t for t in tools if not isinstance(t, dict) or t.get("type") in (None, "function")]


def lacks_system(body: Mapping[str, Any]) -> bool:
    """A chat prompt with no system message of its own, where a chat template may write its default one ahead of the
    messages (`prefix.total_tokens`' `opening`). A plain `prompt` has no template."""
    return not isinstance(body.get("prompt"), str) and bool(messages_of(body)) and not _starts_with_system(body)


def _starts_with_system(body: Mapping[str, Any]) -> bool:
    if body.get("instructions") or body.get("system"):
        return True
    messages = body.get("messages") or body.get("input")
    first = messages[0] if isinstance(messages, list) and messages else None
    return isinstance(first, dict) and first.get("role") in ("system", "developer")
