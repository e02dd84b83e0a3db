"""Qwen Code through the proxy, on bodies of its structure (0.24.4, as recorded against a fake server here): it names
no session, so the reply echo groups a conversation; after each turn it sends a background request (its memory
extraction: another system prompt, 6 of its 14 tools, the conversation so far and an instruction) that must join the
conversation's session as a side request, not start one or move its main line. On a real llama-server."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.processes.servers import LlamaServer, ProxyProcess, wait_until

USER_AGENT = "QwenCode/0.24.4 (linux; x64)"


def _tool(name: str) -> dict[str, Any]:
    parameters = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
    return {
        "type": "function",
        "function": {"name": name, "description": f"Synthetic {name}.", "parameters": parameters},
    }


MAIN_TOOLS = [_tool(f"tool_{i}") for i in range(14)]
SIDE_TOOLS = MAIN_TOOLS[7:13]
MAIN_SYSTEM = "You are a synthetic non-interactive coding agent. Use the tools to do the task. " * 20
SIDE_SYSTEM = "You are a synthetic memory extraction helper. Save what is worth keeping from the conversation. " * 12


@pytest.fixture(scope="module")
def proxy(tiny_server: LlamaServer) -> Iterator[ProxyProcess]:
    proc = ProxyProcess("--profile", f"plain={tiny_server.url}")
    yield proc
    proc.stop()


def _as_qwen_code(proxy: ProxyProcess, body: dict[str, Any]) -> urllib.request.Request:
    """A chat request as Qwen Code sends it: its path under a project, its User-Agent."""
    return urllib.request.Request(
        proxy.base + "/p/qwen/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "User-Agent": USER_AGENT},
    )


def _send(
    proxy: ProxyProcess, system: str, tools: list[dict[str, Any]], messages: list[dict[str, Any]], seed: int = 1
) -> tuple[str, dict[str, Any]]:
    """One streamed request as Qwen Code sends it: the reply's text and the request's record. Sampled with `seed`:
    the tiny model's greedy replies are alike whatever the prompt, and a reply served to two sessions names neither."""
    body = {
        "model": "local",
        "max_tokens": 24,
        "temperature": 1.0,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "system", "content": system}, *messages],
        "tools": tools,
    }
    with urllib.request.urlopen(_as_qwen_code(proxy, body), timeout=120) as resp:
        raw = resp.read().decode()
        request_id = resp.headers["x-adaptive-spec-request-id"]
    text = ""
    for line in raw.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", []):
                text += choice.get("delta", {}).get("content") or ""
    return text, next(r for r in proxy.requests() if r["request_id"] == request_id)


def _conversation(proxy: ProxyProcess, task: str, seed: int) -> list[dict[str, Any]]:
    """A first turn, its background request, a second turn and its background request: the four records."""
    first: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "<env>synthetic</env>"}, {"type": "text", "text": task}]}
    ]
    reply, main = _send(proxy, MAIN_SYSTEM, MAIN_TOOLS, first, seed)
    assert reply.strip(), "the model said nothing: the echo has nothing to group by"
    history = [*first, {"role": "assistant", "content": reply}]
    memory: dict[str, Any] = {"role": "user", "content": [{"type": "text", "text": "Save the memories worth keeping."}]}
    _, side = _send(proxy, SIDE_SYSTEM, SIDE_TOOLS, [*history, memory])
    follow: list[dict[str, Any]] = [
        *history,
        {"role": "user", "content": [{"type": "text", "text": "Now change it to print bye."}]},
    ]
    reply2, main2 = _send(proxy, MAIN_SYSTEM, MAIN_TOOLS, follow, seed + 1)
    _, side2 = _send(proxy, SIDE_SYSTEM, SIDE_TOOLS, [*follow, {"role": "assistant", "content": reply2}, memory])
    return [main, side, main2, side2]


def test_one_session_per_conversation_and_its_background_requests_are_side(proxy: ProxyProcess) -> None:
    one = _conversation(proxy, "Create hello.py that prints hello.", 1)
    two = _conversation(proxy, "Create greet.py that prints hi.", 11)
    for records in (one, two):
        assert len({r["session_id"] for r in records}) == 1, [(r["session_id"], r["session_source"]) for r in records]
        assert [r["side"] for r in records] == [False, True, False, True], records
        assert records[0]["session_source"] == "new" and records[1]["session_source"].startswith("echo:")
        assert {r["client"] for r in records} == {"qwen-code"} and {r["status"] for r in records} == {200}
    assert one[0]["session_id"] != two[0]["session_id"]


def test_a_first_request_given_up_on_and_sent_again_stays_one_conversation(proxy: ProxyProcess) -> None:
    """Qwen Code ends a first request when its timeout runs out before an answer and sends it again: the retry joins
    the abandoned attempt's session (`retry`), so the conversation is one session, not one per attempt."""
    first: list[dict[str, Any]] = [
        {"role": "user", "content": [{"type": "text", "text": "Create retry.py that prints hello."}]}
    ]
    body = {
        "model": "local",
        "max_tokens": 4000,
        "ignore_eos": True,  # still writing when the client gives up
        "stream": True,
        "messages": [{"role": "system", "content": MAIN_SYSTEM}, *first],
        "tools": MAIN_TOOLS,
    }
    with urllib.request.urlopen(_as_qwen_code(proxy, body), timeout=120) as resp:  # given up on at the first chunk
        request_id = resp.headers["x-adaptive-spec-request-id"]
        resp.readline()
    wait_until(lambda: any(r["request_id"] == request_id for r in proxy.requests()), 60, "the abandoned record")
    abandoned = next(r for r in proxy.requests() if r["request_id"] == request_id)
    assert (abandoned["status"], abandoned["session_source"]) == (499, "new"), abandoned
    reply, again = _send(proxy, MAIN_SYSTEM, MAIN_TOOLS, first, seed=3)
    assert (again["session_id"], again["session_source"]) == (abandoned["session_id"], "retry"), again
    # Answered now: the conversation goes on by the reply echo, in the same session.
    follow: list[dict[str, Any]] = [
        *first,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "Now print bye."},
    ]
    _, next_turn = _send(proxy, MAIN_SYSTEM, MAIN_TOOLS, follow, seed=4)
    assert next_turn["session_id"] == abandoned["session_id"], next_turn
