"""The stages benchmark times the request handler's own stages: each named stage function is called, in the handler's
order, once per timed request, and every stage of the table gets a figure."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
from benchmarks.harness.agent_bodies import AgentRequest
from benchmarks.overhead import stages

from adaptive_spec.requests import handler, outgoing
from adaptive_spec.requests.lifecycle import RequestLifecycle


class _Letters:
    """A tokenizer of one token a character: the update needs counts, not a vocabulary."""

    name = "letters"

    async def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return [[ord(c) for c in text] for text in texts]


def _agent() -> AgentRequest:
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are a coding agent. Working directory: /home/u/project"},
            {"role": "user", "content": "Read main.py and tell me what it does."},
        ],
        "stream": True,
    }
    return AgentRequest("openai_sdk", "/v1/chat/completions", {"User-Agent": "OpenAI/Python 1.0"}, body)


@pytest.mark.asyncio(loop_scope="function")
async def test_each_of_the_handler_s_stages_is_called_and_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    called: list[str] = []

    def spy(owner: Any, name: str) -> None:
        real: Callable[..., Any] = getattr(owner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            called.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    for name in ("read", "group", "rewrite", "route"):
        spy(handler, name)
    spy(outgoing, "upstream_body")
    spy(RequestLifecycle, "finish")
    row = await stages.measure(_agent(), 3000, 1, _Letters, "next")
    # Two repetitions (the first warms caches), each a served request and the next turn timed.
    turn = ["read", "group", "rewrite", "route", "upstream_body", "finish"]
    assert called == turn * 4
    assert set(row["stages_ms"]) == set(stages.STAGES)
    timed = [s for s in stages.STAGES if s not in ("worker thread", "tokenize")]
    assert all(row["stages_ms"][s] > 0 for s in timed), row["stages_ms"]
    assert row["request_path_ms"] > row["stages_ms"]["route"] > 0
