"""Incremental fingerprints: a turn that reuses its session's previous digests gets exactly what a full scan gets."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import random
from typing import Any

import orjson
import pytest

from adaptive_spec.requests.body.parse import with_fields
from adaptive_spec.routing.prompt import prefix
from adaptive_spec.routing.prompt.pieces import Piece, prompt_pieces
from adaptive_spec.sessions.messages import context_messages, message_digest
from adaptive_spec.telemetry.records import Timings
from tests.support.waiting import until

_ALPHABET = 'ab cd\tef\ngh\r\x0b\x0c\x1c\x1d\x1e\x1f{}"é\u00a0\u2003\u3000漢 \x85'


def _old_digest(role: str, text: str) -> bytes:
    """The digest as it was first defined: whitespace removed by splitting into words."""
    data = (role + "\0" + "".join(text.split())).encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=12).digest()


def _text(rng: random.Random, ascii_only: bool) -> str:
    alphabet = _ALPHABET[:17] if ascii_only else _ALPHABET
    return "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 60)))


@pytest.mark.parametrize("seed", range(40))
def test_the_fast_digest_is_the_digest_of_the_words(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        text = _text(rng, ascii_only=rng.random() < 0.7)
        role = rng.choice(["user", "assistant", "tool", "system", "ro le", "función"])
        assert message_digest(role, text) == _old_digest(role, text), (role, text)


def _message(rng: random.Random, n: int) -> dict[str, Any]:
    role = rng.choice(["user", "assistant", "tool"])
    text = f"message {n}: " + _text(rng, ascii_only=rng.random() < 0.8)
    if role == "assistant" and rng.random() < 0.5:
        call = {"id": f"call_{n}", "type": "function", "function": {"name": "read", "arguments": text}}
        return {"role": role, "content": "", "tool_calls": [call]}
    if rng.random() < 0.2:
        return {"role": role, "content": [{"type": "text", "text": text}, {"type": "text", "text": "more"}]}
    return {"role": role, "content": text}


def _next(rng: random.Random, body: dict[str, Any], n: int) -> dict[str, Any]:
    """The session's next request: mostly appended to, sometimes rewritten (an edit, a removal, a swap)."""
    out = copy.deepcopy(body)
    messages = out["messages"]
    roll = rng.random()
    if roll < 0.15 and len(messages) > 2:
        i = rng.randrange(1, len(messages))
        messages[i] = {"role": messages[i]["role"], "content": str(messages[i].get("content")) + " edited"}
    elif roll < 0.25 and len(messages) > 2:
        del messages[rng.randrange(1, len(messages))]
    elif roll < 0.3 and len(messages) > 3:
        i = rng.randrange(1, len(messages) - 1)
        messages[i], messages[i + 1] = messages[i + 1], messages[i]
    elif roll < 0.35:
        messages[-1] = {"role": "user", "content": "the same length?"}  # same text length, other text
    messages += [_message(rng, n + k) for k in range(rng.randrange(1, 3))]
    if rng.random() < 0.1:
        out["tools"] = [{"type": "function", "function": {"name": f"t{n}"}}]
    return out


def _plain(pieces: tuple[Piece, ...]) -> list[tuple[bytes, int, bool, bool]]:
    return [(p.digest, p.chars, p.assistant, p.tools) for p in pieces]


@pytest.mark.parametrize("seed", range(30))
def test_incremental_pieces_and_estimates_equal_a_full_scan(seed: int) -> None:
    rng = random.Random(1000 + seed)
    body: dict[str, Any] = {"messages": [{"role": "system", "content": "You are a coding agent."}]}
    incremental = full = None
    for turn in range(25):
        body = _next(rng, body, turn * 10)
        has_tools = bool(body.get("tools"))
        scanned = prompt_pieces(body)
        reused = prompt_pieces(body, incremental.pieces if incremental is not None else ())
        assert _plain(reused) == _plain(scanned)
        assert [p.digest for p in scanned if not p.tools] == [d for d, _, _ in context_messages(body)]
        assert prefix.estimate(incremental, reused, has_tools, 3.5) == prefix.estimate(full, scanned, has_tools, 3.5)
        timings = Timings(prompt_n=50 + turn, cache_n=100 * turn, predicted_n=20)
        reply = f"reply {turn}"
        incremental = prefix.observe(incremental, reused, has_tools, reply, timings)
        full = prefix.observe(full, scanned, has_tools, reply, timings)
        assert incremental == full


def test_a_message_with_the_same_length_but_another_text_is_hashed_again() -> None:
    first = prompt_pieces({"messages": [{"role": "user", "content": "abc"}]})
    second = prompt_pieces({"messages": [{"role": "user", "content": "abd"}]}, first)
    assert second[0].digest == message_digest("user", "abd") != first[0].digest
    moved = prompt_pieces({"messages": [{"role": "tool", "content": "abc"}]}, first)
    assert moved[0].digest == message_digest("tool", "abc")  # the role is part of what is compared


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model":"m","messages":[]}',
        b'  {\n "messages": [{"role": "user", "content": "h\\u00e9"}], "stream": true}  ',
        b"{}",
        b"{ }",
        b"{" + b" \n" * 100 + b"}",
    ],
)
def test_fields_are_spliced_into_the_clients_bytes(raw: bytes) -> None:
    out = with_fields(raw, {"timings_per_token": True, "id_slot": 2})
    assert orjson.loads(out) == {**orjson.loads(raw), "timings_per_token": True, "id_slot": 2}
    assert raw.strip().lstrip(b"{").lstrip() in out  # the rest of the client's bytes as they came


class _Tokens:
    name = "words"

    async def encode(self, texts: Any) -> list[list[int]]:
        return [[len(word) for word in text.split()] for text in texts]


def _served(text: str) -> Any:
    from adaptive_spec.streams.output import OutputCollector

    out = OutputCollector()
    out.add([text], [])
    return out


@pytest.mark.asyncio
@pytest.mark.parametrize("in_process", [False, True])
async def test_waiting_updates_of_a_session_are_coalesced_and_the_rest_bounded(in_process: bool) -> None:
    from adaptive_spec.sessions.grouping import SessionAssignment
    from adaptive_spec.sessions.ngram_replay import NgramParams
    from adaptive_spec.sessions.service import SessionService
    from adaptive_spec.sessions.statistics import ContextTracker, closing, opening

    tracker = ContextTracker(NgramParams())
    service = SessionService(tracker, _Tokens(), queue_size=2, queue_bytes=1000, worker_process=in_process)
    a, b, c = (SessionAssignment(s, "new") for s in "abc")
    turn1 = {"messages": [{"role": "user", "content": "one two three"}]}
    turn2 = {
        "messages": [*turn1["messages"], {"role": "assistant", "content": "x y"}, {"role": "user", "content": "z"}]
    }
    service.finished(a, "p", turn1, _served("x y"), body_bytes=100)
    service.finished(a, "p", turn2, _served("w"), body_bytes=150, line_moved=True)  # supersedes the waiting one
    service.finished(b, "p", turn1, _served("v"), body_bytes=100)
    service.finished(c, "p", turn1, _served("u"), body_bytes=100)  # a third session waiting: over the bound
    service.finished(a, "p", turn1, _served("t"), body_bytes=100, side=True)  # a side request waits on its own
    assert service.update_counts() == {"processed": 0, "coalesced": 1, "dropped": 2}
    assert service._waiting[("a", False)].line_moved  # what the superseded update carried is kept
    worker = asyncio.create_task(service.run())
    await service.drain()
    worker.cancel()
    assert service.update_counts()["processed"] == 2
    snapshots = {s.session_id: s for s in service.snapshots()}
    assert snapshots.keys() == {"a", "b"}
    # turn2 whole (3 messages, 6 tokens) and its reply (1), each in its framing; both turns count
    framing = len(opening("user") + closing("user"))
    assert len(opening("assistant") + closing("assistant")) == framing == 5
    assert snapshots["a"].turns == 2 and snapshots["a"].indexed_tokens == 6 + 1 + 4 * framing
    assert service.copy_state("a")[0] == 2
    assert await service.settled("a", 0.01)
    assert (len(tracker.snapshots()) == 0) is in_process  # in a worker process, the proxy's own tracker stays empty


def test_session_updates_are_counted_in_metrics() -> None:
    from adaptive_spec.telemetry.metrics import ProxyMetrics

    metrics = ProxyMetrics()
    counts = {"processed": 5, "coalesced": 2, "dropped": 0}
    metrics.watch_session_updates(lambda: counts)
    counts["dropped"] = 3  # read at each scrape
    text = metrics.render().decode()
    assert 'adaptive_spec_session_updates_total{outcome="dropped"} 3.0' in text
    assert 'adaptive_spec_session_updates_total{outcome="coalesced"} 2.0' in text


@pytest.mark.asyncio
async def test_the_worker_process_starts_with_the_worker_not_with_the_first_update() -> None:
    # Seen under serve: three quick turns of one session, the first update waiting for the process to spawn and the
    # second coalesced into the third (2 turns shown for 3 requests).
    from adaptive_spec.sessions.backends import ProcessStatistics
    from adaptive_spec.sessions.ngram_replay import NgramParams
    from adaptive_spec.sessions.service import SessionService
    from adaptive_spec.sessions.statistics import ContextTracker

    service = SessionService(ContextTracker(NgramParams()), _Tokens(), worker_process=True)
    worker = asyncio.create_task(service.run())
    try:
        backend = service.backend
        assert isinstance(backend, ProcessStatistics)
        await until(lambda: backend.started, "a worker process before any update")
        assert service.update_counts() == {"processed": 0, "coalesced": 0, "dropped": 0}
    finally:
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await worker


@pytest.mark.asyncio
async def test_the_worker_process_tokenizes_itself_and_gets_what_the_event_loop_got() -> None:
    """With a tokenizer it can make again (here tiktoken's), the worker process is sent the client's bytes and
    tokenizes them itself; its statistics are those of the update tokenized on the event loop."""
    from adaptive_spec.sessions.backends import ProcessStatistics
    from adaptive_spec.sessions.grouping import SessionAssignment
    from adaptive_spec.sessions.ngram_replay import NgramParams
    from adaptive_spec.sessions.service import SessionService
    from adaptive_spec.sessions.statistics import ContextTracker
    from adaptive_spec.sessions.tokenizers import CachingTokenizer, TokenizerSpec, tiktoken_o200k

    tokenizer = CachingTokenizer(tiktoken_o200k())
    assert tokenizer.spec == TokenizerSpec("tiktoken")
    history = [{"role": "system", "content": "You edit code."}, {"role": "user", "content": "def f(x):\n  return x\n"}]
    reply = "def f(x):\n    return x + 1\n"
    turns = [
        {"messages": history},
        {"messages": [*history, {"role": "assistant", "content": reply}, {"role": "user", "content": "again"}]},
    ]
    results = {}
    for worker_tokenizes in (False, True):
        service = SessionService(ContextTracker(NgramParams()), tokenizer, worker_process=True)
        if not worker_tokenizes:
            backend = service.backend
            assert isinstance(backend, ProcessStatistics)
            backend.spec = None  # the event loop tokenizes, the worker process picks and folds
        worker = asyncio.create_task(service.run())
        try:
            for body in turns:
                raw = orjson.dumps(body)
                service.finished(SessionAssignment("s", "new"), "p", body, _served(reply), raw_body=raw)
                await service.drain()
        finally:
            worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker
        (snap,) = service.snapshots()
        results[worker_tokenizes] = (snap.turns, snap.indexed_tokens, snap.est_accepted_share_ewma)
    assert results[True] == results[False]
    assert results[True][0] == 2 and results[True][1] > 20


def test_known_digests_give_message_digest_and_digest_only_new_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    from adaptive_spec.sessions import messages

    computed: list[str] = []
    real = messages.message_digest

    def counting(role: str, text: str) -> bytes:
        computed.append(text)
        return real(role, text)

    monkeypatch.setattr(messages, "message_digest", counting)
    known = messages.KnownDigests()
    turn1 = {"messages": [{"role": "system", "content": "rules"}, {"role": "user", "content": "edit a.py"}]}
    new = [{"role": "assistant", "content": "done"}, {"role": "user", "content": "edit b.py"}]
    turn2 = {"messages": [*turn1["messages"], *new]}
    for turn in (turn1, turn2):
        computed.clear()
        got = messages.context_messages(turn, known)
        known.turn()
        assert [d for d, _, _ in got] == [real(m["role"], m["content"]) for m in turn["messages"]]
    assert computed == ["done", "edit b.py"]  # the second turn digested only its two new messages
    same_length = {"messages": [{"role": "system", "content": "RULES"}, {"role": "user", "content": "edit a.py"}]}
    computed.clear()
    got = messages.context_messages(same_length, known)
    assert got[0][0] == real("system", "RULES") and computed == ["RULES"]  # same length, other text: digested
