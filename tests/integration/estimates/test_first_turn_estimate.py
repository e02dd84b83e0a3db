"""A long first turn's new-token estimate against llama-server's own `prompt_n`, on the real Qwen2.5-Coder-0.5B behind
`adaptive-spec serve` started fresh (no session has taught it a rate): an agent's first turn, English instructions and
JSON tool schemas (~5 characters a token on Qwen's vocabulary, where the prior is 3.5), is counted with the model's own
tokenizer before it is routed, so its estimate is within 15% where the prior alone missed by a third."""

from __future__ import annotations

import json
import random
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes.servers import ProxyProcess

ESTIMATE_ERROR = 0.15
_GUIDE = (
    "Read the relevant files before you change them, and keep every change as small as the task allows.",
    "Explain briefly why a change is needed, then show the new version of the function you modified.",
    "When the tests fail, report the failing assertion together with the command that reproduces it.",
    "Prefer the conventions already used in the repository over your own preferences for formatting.",
    "Never commit generated files, credentials or anything the user did not ask you to change today.",
    "Ask a question only when the instructions are ambiguous; otherwise choose the simplest reading.",
)


@pytest.fixture(scope="module")
def fresh(qwen_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    state = tmp_path_factory.mktemp("state")
    proxy = ProxyProcess("--threads", "1", "--ctx-size", "8192", env={"ADAPTIVE_SPEC_STATE_DIR": str(state)})
    yield proxy
    proxy.stop()


def _first_turn() -> dict[str, Any]:
    rng = random.Random(7)
    rules = "\n".join(rng.choice(_GUIDE) for _ in range(80))
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": f"Tool {i}: reads or changes the project's files as its arguments say.",
                "parameters": {
                    "type": "object",
                    "properties": {f"arg_{j}": {"type": "string", "description": f"Argument {j}."} for j in range(4)},
                    "required": ["arg_0"],
                },
            },
        }
        for i in range(4)
    ]
    system = f"You are a coding agent. Use the tools.\n{rules}"
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Add a /health endpoint."}]
    return {"model": "m", "messages": messages, "tools": tools, "max_tokens": 4, "temperature": 0}


def _served(proxy: ProxyProcess, body: dict[str, Any], session: str) -> dict[str, Any]:
    """The proxy's record of a chat request it answered."""
    req = urllib.request.Request(
        proxy.base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "x-session-id": session},
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        request_id = resp.headers["x-adaptive-spec-request-id"]
        resp.read()
    return next(r for r in proxy.requests() if r["request_id"] == request_id)


def test_a_long_first_turn_is_estimated_within_15_percent_on_a_fresh_proxy(fresh: ProxyProcess) -> None:
    body = _first_turn()
    assert len(json.dumps(body)) > 8_000  # long enough to be counted
    record = _served(fresh, body, "first")
    est, true = record["new_tokens_est"], record["timings"]["prompt_n"]
    assert record["timings"]["cache_n"] < 8 and true > 1_500, record["timings"]
    assert abs(est - true) <= ESTIMATE_ERROR * true, (est, true)
    # The prior alone (3.5 characters a token) would have missed it by more than the bound.
    chars = sum(len(m["content"]) for m in body["messages"]) + len(json.dumps(body["tools"], separators=(",", ":")))
    assert abs(chars / 3.5 - true) > ESTIMATE_ERROR * true, (chars / 3.5, true)


BARE_ERROR = 0.2


def test_a_question_without_a_system_message_counts_the_templates_default_one(fresh: ProxyProcess) -> None:
    # Qwen's template writes "You are Qwen, created by Alibaba Cloud..." ahead of it: 16 of its 38 prompt tokens.
    question = "Write a python function that adds two numbers."
    body = {"model": "m", "messages": [{"role": "user", "content": question}], "max_tokens": 2, "temperature": 0}
    record = _served(fresh, body, "bare")
    # Nothing the router knows of is held for it, so its new tokens are its whole prompt; llama-server may still reuse
    # the few tokens another session's prompt opens with ("<|im_start|>system\nYou are").
    timings = record["timings"]
    est, true = record["new_tokens_est"], timings["prompt_n"] + timings["cache_n"]
    assert timings["cache_n"] < 8 and true > 30, timings
    assert abs(est - true) <= BARE_ERROR * true, (est, true)
    print(f"bare question: estimated {est} new tokens, llama-server counted {true}")
    # The request's own texts and their markers alone, at any rate from 3 to 6 characters a token, miss by more.
    for rate in (3.0, 3.5, 5.0, 6.0):
        alone = len(question) / rate + 5 + 4
        assert abs(alone - true) > BARE_ERROR * true, (rate, alone, true)
