"""A session's next turn is sent to the statistics worker process as only the messages that follow those of its
last folded request, and its statistics are those of the whole body sent."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson
import pytest

from adaptive_spec.sessions.backends import ProcessStatistics, _Sent
from adaptive_spec.sessions.grouping import SessionAssignment
from adaptive_spec.sessions.ngram_replay import NgramParams
from adaptive_spec.sessions.service import SessionService
from adaptive_spec.sessions.statistics import ContextTracker
from adaptive_spec.sessions.tokenizers import CachingTokenizer, tiktoken_o200k
from adaptive_spec.streams.output import OutputCollector
from adaptive_spec.telemetry.events import Event, SessionUpdated

_FILE = "\n".join(f"def handler_{i}(value):\n    return value * {i} + len(str(value))\n" for i in range(40))


def _reply(text: str, calls: list[tuple[str, str]] = ()) -> OutputCollector:  # type: ignore[assignment]
    from adaptive_spec.streams.output import call_head

    out = OutputCollector()
    out.add([text], [])
    for call_id, arguments in calls:
        out.add([call_head("read"), arguments], [call_id])
    return out


def _turns() -> list[tuple[dict[str, Any], OutputCollector]]:
    """An agent's session: a tool call reads a file, the model edits it, the history grows by appending."""
    system = {"role": "system", "content": "You are a coding agent. Use the tools."}
    history: list[dict[str, Any]] = [system, {"role": "user", "content": "fix handler_3 in app.py"}]
    turns = []
    for i in range(4):
        call_id = f"call_{i}"
        arguments = orjson.dumps({"path": f"app{i}.py"}).decode()
        body = {"model": "m", "messages": [*history], "tools": [{"type": "function", "function": {"name": "read"}}]}
        turns.append((body, _reply("", [(call_id, arguments)])))
        call = {"id": call_id, "type": "function", "function": {"name": "read", "arguments": arguments}}
        history += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call_id, "content": _FILE.replace("handler", f"handler{i}")},
        ]
    body = {"model": "m", "messages": [*history, {"role": "user", "content": "now return the updated file"}]}
    turns.append((body, _reply(_FILE.replace("return value", "return  value"))))
    return turns


def _backend(service: SessionService) -> ProcessStatistics:
    assert isinstance(service.backend, ProcessStatistics)
    return service.backend


def _sent(service: SessionService) -> tuple[int, int]:
    """Updates sent only their new messages, and of those the ones the child asked for whole after all."""
    return _backend(service).sent_new_only, _backend(service).sent_again


async def _serve(new_only: bool, tamper: bool = False) -> tuple[list[dict[str, Any]], SessionService, list[int]]:
    events: list[Event] = []
    service = SessionService(
        ContextTracker(NgramParams()), CachingTokenizer(tiktoken_o200k()), publish=events.append, worker_process=True
    )
    sizes: list[int] = []
    backend = _backend(service)
    real_rest = backend._rest

    def rest(work: Any, messages: list[Any]) -> Any:
        found = real_rest(work, messages) if new_only else None
        if found is not None:
            sizes.append(len(found[1]))
        return found

    backend._rest = rest  # type: ignore[method-assign]
    worker = asyncio.create_task(service.run())
    try:
        for i, (body, reply) in enumerate(_turns()):
            if tamper and i == 2:  # as if the worker had folded another request last (it started again, say)
                sent = backend._sent.get("s")
                assert sent is not None
                backend._sent.put("s", _Sent("another", sent.messages, sent.weight))
            raw = orjson.dumps(body)
            assignment = SessionAssignment("s", "new")
            service.finished(assignment, "p", body, reply, f"r{i}", body_bytes=len(raw), raw_body=raw)
            await service.drain()  # one update per turn: none joins another
    finally:
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await worker
    turns = [e.turn for e in events if isinstance(e, SessionUpdated)]
    return turns, service, sizes


@pytest.mark.asyncio
async def test_a_next_turn_is_sent_only_its_new_messages_and_folds_as_the_whole_body() -> None:
    whole, _, _ = await _serve(new_only=False)
    new_only, service, sizes = await _serve(new_only=True)
    assert len(whole) == 5 and whole[-1]["new_prompt_tokens"] > 0 and any(t["est_accepted"] > 0 for t in whole)
    assert new_only == whole  # every turn's statistics, field for field
    # From the third turn on: a session's first request is not kept (a conversation of one request would only
    # hold its body in memory), so its second is sent whole.
    assert _sent(service) == (3, 0)
    said = service.to_json()
    assert (said["updates_sent_new_only"], said["updates_sent_again"]) == (3, 0)
    assert _backend(service)._sent.get("s") is not None
    body, _ = _turns()[-1]
    # The last turn sent its one new message (and the tool result before it), not the history of four files.
    assert sizes[-1] < len(orjson.dumps(body)) / 3


@pytest.mark.asyncio
async def test_a_worker_that_folded_another_request_last_is_sent_the_whole_body() -> None:
    whole, _, _ = await _serve(new_only=False)
    tampered, service, _ = await _serve(new_only=True, tamper=True)
    assert tampered == whole
    assert _sent(service) == (3, 1)


@pytest.mark.asyncio
async def test_a_rewritten_history_is_sent_whole() -> None:
    _, service, _ = await _serve(new_only=True)
    first = {
        "model": "m",
        "messages": [{"role": "system", "content": "Other rules."}, {"role": "user", "content": "?"}],
    }
    raw = orjson.dumps(first)
    worker = asyncio.create_task(service.run())
    try:
        before = _sent(service)[0]
        assignment = SessionAssignment("s", "new")
        service.finished(assignment, "p", first, _reply("ok"), "r9", body_bytes=len(raw), raw_body=raw)
        await service.drain()
        assert _sent(service)[0] == before  # nothing repeated: the whole body went
        assert service.processed == 6
        service.finished(
            SessionAssignment("t", "new"), "p", first, _reply("ok"), "t1", body_bytes=len(raw), raw_body=raw
        )
        await service.drain()
        assert _backend(service)._sent.get("t") is None  # a conversation of one request is not kept
    finally:
        worker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await worker
