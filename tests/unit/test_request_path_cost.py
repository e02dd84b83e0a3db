"""What the request path no longer does twice gives what doing it every time gave: the reply echo's line keys and its
remembered scans, pieces taken from another session's request, the copy hint's remembered blocks, and a large worker
call written without joining its frame."""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Mapping
from typing import Any

import pytest

from adaptive_spec.common.child_process import _drop_written
from adaptive_spec.common.lru import LRU
from adaptive_spec.policy.model import Policy
from adaptive_spec.routing.prompt import first_turn as copy_hint
from adaptive_spec.routing.prompt import prefix
from adaptive_spec.routing.prompt.pieces import BLOCK_CHARS, Piece, PieceCache, prompt_pieces, shared_chars
from adaptive_spec.sessions import grouping, messages
from adaptive_spec.sessions.grouping import SessionRegistry
from adaptive_spec.sessions.messages import message_text, messages_of

_WORDS = ("value", "index", "result", "buffer", "parser", "session", "stream", "handler", "return", "config")


def _line(rng: random.Random) -> str:
    words = " ".join(rng.choice(_WORDS) for _ in range(rng.randrange(2, 9)))
    return rng.choice(("", "    ", "\t", "+ ", "- ", "> ", " +\t")) + words + rng.choice(("", "  ", "\t"))


def _text(rng: random.Random, served: list[str]) -> str:
    lines = [rng.choice(served) if served and rng.random() < 0.3 else _line(rng) for _ in range(rng.randrange(1, 30))]
    return rng.choice(("\n", "\r\n", "\n\n")).join(lines)


class _Reference:
    """The reply echo as it was before its keys and scans were remembered: a blake2b digest of every line, every
    line of every message read at each request (the same bounds, so the same lines are forgotten)."""

    def __init__(self, max_fingerprints: int) -> None:
        self.replies: LRU[bytes, str] = LRU(max_fingerprints)
        self.lines: LRU[bytes, str] = LRU(max_fingerprints)

    @staticmethod
    def _digest(text: str) -> bytes:
        return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=12).digest()

    def _put(self, table: LRU[bytes, str], key: bytes, session_id: str) -> None:
        previous = table.get(key)
        table.put(key, session_id if previous in (None, session_id) else "")

    def note_reply(self, session_id: str, text: str) -> None:
        if text.strip():
            self._put(self.replies, self._digest(" ".join(text.split())), session_id)
            for line in itertools.islice(dict.fromkeys(grouping._echo_lines(text)), 400):
                self._put(self.lines, self._digest(line), session_id)

    def echo(self, body: Mapping[str, Any]) -> tuple[str, str] | None:
        messages = messages_of(body)
        for message in reversed(messages):
            if message.get("role") == "assistant":
                hit = self.replies.get(self._digest(" ".join(message_text(message.get("content")).split())))
                if hit:
                    return hit, "echo:reply"
        system = {
            self._digest(line)
            for m in messages
            if m.get("role") in ("system", "developer")
            for line in grouping._echo_lines(message_text(m.get("content")))
        }
        votes: dict[str, int] = {}
        for message in messages:
            if message.get("role") in ("system", "developer"):
                continue
            for line in dict.fromkeys(grouping._echo_lines(message_text(message.get("content")))):
                key = self._digest(line)
                hit = self.lines.get(key) if key not in system else None
                if hit:
                    votes[hit] = votes.get(hit, 0) + 1
        if not votes:
            return None
        best, count = max(votes.items(), key=lambda kv: kv[1])
        return (best, "echo:lines") if count >= 2 else None


@pytest.mark.parametrize("seed", range(12))
def test_the_line_echo_finds_what_reading_every_line_found(seed: int) -> None:
    rng = random.Random(seed)
    bound = rng.choice((40, 400, 200_000))  # small bounds: served lines are forgotten along the way
    registry, reference = SessionRegistry(bound), _Reference(bound)
    served: list[str] = []
    bodies: list[dict[str, Any]] = []
    for turn in range(60):
        reply = _text(rng, served)
        sid = f"s{rng.randrange(8)}"
        registry.note_reply(sid, reply, [])
        reference.note_reply(sid, reply)
        served += [line.strip() for line in reply.splitlines() if len(line.strip()) > 30][:5]
        messages: list[dict[str, Any]] = [{"role": "system", "content": _text(rng, served)}]
        for _ in range(rng.randrange(1, 6)):
            role = rng.choice(("user", "tool", "assistant", "developer"))
            content: Any = _text(rng, served) * rng.choice((1, 1, 200))  # some long enough to be remembered
            if rng.random() < 0.2:
                content = [{"type": "text", "text": content}, {"type": "text", "text": _text(rng, served)}]
            messages.append({"role": role, "content": content})
        bodies.append({"messages": messages})
        for body in (bodies[-1], rng.choice(bodies)):  # new texts and texts seen before
            found = registry.assign({}, body)
            expected = reference.echo(body)
            if expected is None:
                assert found.source == "new", turn
            else:
                assert (found.session_id, found.source) == expected, turn


def test_a_long_text_is_read_for_lines_once_whoever_sends_it(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = SessionRegistry()
    registry.note_reply("ses_a", "\n".join(f"served line number {i} of the answer" for i in range(10)), [])
    long_file = "\n".join(f"    return value_{i} * index_{i} + buffer" for i in range(2000))
    body = {"messages": [{"role": "user", "content": long_file}, {"role": "user", "content": "short one"}]}
    read: list[int] = []
    original = grouping.echo_line_keys

    def counted(text: str) -> Any:
        read.append(len(text))
        return original(text)

    monkeypatch.setattr(grouping, "echo_line_keys", counted)
    assert registry.assign({}, body).source == "new"
    assert registry.assign({"x-session-id": "other"}, body).source == "header:x-session-id"  # no scan at all
    again = {"messages": [*body["messages"], {"role": "user", "content": "served line number 3 of the answer"}]}
    assert registry.assign({}, again).source == "new"  # one quoted line is not enough
    assert read.count(len(long_file)) == 1  # the long text: once; a short one is read each time
    quoted = {"messages": [*again["messages"], {"role": "tool", "content": "served line number 7 of the answer"}]}
    assert (registry.assign({}, quoted).session_id, registry.assign({}, quoted).source) == ("ses_a", "echo:lines")


def _as_plain(pieces: tuple[Piece, ...]) -> list[tuple[bytes, int, bool, bool, bytes, float]]:
    return [(p.digest, p.chars, p.assistant, p.tools, p.blocks, p.extra) for p in pieces]


def test_pieces_of_texts_another_session_sent_are_taken_not_hashed(monkeypatch: pytest.MonkeyPatch) -> None:
    tools = [{"type": "function", "function": {"name": "read", "description": "d" * 900}}]
    history = [
        {"role": "system", "content": "You are an agent. " * 100},
        {"role": "user", "content": "fix it " * 300},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "def f():\n    return 1\n" * 400},
    ]
    first = {"messages": history, "tools": tools}
    later = {"messages": [*history, {"role": "user", "content": "and now the tests"}], "tools": tools}
    table = prefix.PrefixTable()
    assert _as_plain(table.pieces(first, None)) == _as_plain(prompt_pieces(first))
    hashed: list[str] = []

    def counted(role: str, text: str) -> bytes:
        hashed.append(text)
        return messages.message_digest(role, text)

    monkeypatch.setattr("adaptive_spec.routing.prompt.pieces.message_digest", counted)
    # Another session (no state of its own) whose request carries the same history: only its new message is hashed.
    reused = table.pieces(later, None)
    assert hashed == ["and now the tests"]
    monkeypatch.undo()
    assert _as_plain(reused) == _as_plain(prompt_pieces(later))


def test_block_keys_count_the_leading_blocks_two_texts_share() -> None:
    base = "x" * 1000
    a = prompt_pieces({"prompt": base + "a" * 600})[0]
    b = prompt_pieces({"prompt": base + "b" * 600})[0]
    assert shared_chars(a, b) == 1000 // BLOCK_CHARS * BLOCK_CHARS
    message = prompt_pieces({"messages": [{"role": "user", "content": base}]})[0]
    reply = prompt_pieces({"messages": [{"role": "assistant", "content": base}]})[0]
    assert shared_chars(message, reply) == 0  # the kind is part of the first block's key


def test_the_piece_cache_is_bounded_by_its_block_bytes() -> None:
    cache = PieceCache(max_pieces=100, max_block_bytes=4096)
    for i in range(20):
        cache.put(Piece(b"d", 256 * 64, blocks=b"k" * 8 * 64, key=i))  # 512 bytes of block keys each
    assert [cache.get(i, 256 * 64) is not None for i in range(20)] == [False] * 12 + [True] * 8


def test_a_long_texts_pasted_block_is_found_once(monkeypatch: pytest.MonkeyPatch) -> None:
    pasted = "```python\n" + "\n".join(f"line {i} = {i}" for i in range(600)) + "\n```"
    body = {"messages": [{"role": "user", "content": pasted}, {"role": "user", "content": "Return the full file."}]}
    policy = Policy().first_turn
    scans: list[int] = []
    original = copy_hint._scan

    def counted(text: str) -> tuple[int, int]:
        scans.append(len(text))
        return original(text)

    monkeypatch.setattr(copy_hint, "_scan", counted)
    first = copy_hint.pasted_file_chars(body, policy)
    assert first == copy_hint.pasted_file_chars(body, policy) == original(pasted)[1] > 0
    assert scans.count(len(pasted)) == 1


def test_a_large_worker_call_is_taken_off_its_parts_as_written() -> None:
    parts = [memoryview(b"\x00\x00\x00\x06"), memoryview(b"abcdef")]
    _drop_written(parts, 2)
    assert [bytes(p) for p in parts] == [b"\x00\x06", b"abcdef"]
    _drop_written(parts, 3)
    assert [bytes(p) for p in parts] == [b"bcdef"]
    _drop_written(parts, 0)
    assert [bytes(p) for p in parts] == [b"bcdef"]
    _drop_written(parts, 5)
    assert parts == []


def test_a_long_text_sent_again_is_tested_against_the_lines_served_since() -> None:
    registry = SessionRegistry()
    long_file = "\n".join(f"    return value_{i} * index_{i} + buffer" for i in range(200))
    body = {"messages": [{"role": "user", "content": long_file}]}
    assert registry.assign({}, body).source == "new"
    assert registry.assign({}, body).source == "new"  # known to quote nothing served
    registry.note_reply("ses_b", "unrelated words, long enough to be remembered here", [])
    assert registry.assign({}, body).source == "new"  # tested against that one line only
    # Two of its lines served since (the reply quoted them): the text now echoes that session.
    registry.note_reply("ses_b", "    return value_7 * index_7 + buffer\n    return value_9 * index_9 + buffer", [])
    found = registry.assign({}, body)
    assert (found.session_id, found.source) == ("ses_b", "echo:lines")
