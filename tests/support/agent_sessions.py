"""Agent-shaped sessions replayed through a proxy, turn by turn, with the proxy's record of each request: Claude Code's
(`/v1/messages`, its billing line changing each request, optionally a compaction-like side request after the second
turn), Qwen Code's (chat, 14 tools, no session id, its memory side request after each of the first turns) and Gemini
CLI's (its model router's classifier before each user turn, then two model turns and the last one's prompt sent
again). The bodies are synthetic, of the shapes in tests/data/agent-shapes/: no agent's own text.

Used by the follow-up estimate tests and by `benchmarks.estimates.follow_ups`."""

from __future__ import annotations

import copy
import json
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.processes.servers import ProxyProcess

SHAPES = Path(__file__).resolve().parents[1] / "data" / "agent-shapes"
GUIDE = "You are a synthetic coding agent. Read before you edit, keep answers short, and say what you changed. "
CLASSIFIER = "Score how hard the request is, from 1 to 100, and say why, in JSON, weighing the files it names. "
BILLING = "x-anthropic-billing-header: cc_version=2.1.332.abc; cc_entrypoint=cli; cch={};"
GEMINI_UA = "GeminiCLI/0.61.0/gemini-3.1-pro-preview (linux; x64)"

# (path, body, headers) -> (the answer, the proxy's record of the request)
Post = Callable[[str, dict[str, Any], dict[str, str]], tuple[Any, dict[str, Any]]]


@dataclass(frozen=True)
class Sent:
    """One request of a replay: its record, and whether the agent sent it beside its conversation (a side request)."""

    record: dict[str, Any]
    aside: bool = False


def poster(proxy: ProxyProcess, timeout_s: float = 1800) -> Post:
    """Posts through `proxy`; an error answer raises with its status and the start of its body."""

    def post(path: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[Any, dict[str, Any]]:
        req = urllib.request.Request(
            proxy.base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **headers}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                answer = json.loads(resp.read())
                request_id = resp.headers["x-adaptive-spec-request-id"]
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{path}: {exc.code}: {exc.read()[:500]!r}") from exc
        return answer, next(r for r in proxy.requests() if r["request_id"] == request_id)

    return post


def tool_result(turn: int) -> str:
    """A tool result of a few hundred tokens of code, different each turn: a file read back, numbered as agents show
    it."""
    lines = []
    for i in range(6):
        lines += [
            f"def step_{turn}_{i}(items, limit={i + turn}):",
            f'    """Return the first {i + turn} items of the list, each one checked."""',
            "    return [item for item in items[:limit] if item is not None]",
            "",
        ]
    return "".join(f"{n + 1:4d}\t{line}\n" for n, line in enumerate(lines))


def claude_code(post: Post, session: str, *, compaction: bool = False) -> list[Sent]:
    """Five turns of one session (`X-Claude-Code-Session-Id`); with `compaction`, a side request of its own system
    prompt after the second."""
    body = json.loads((SHAPES / "claude-code-messages.json").read_text())
    headers = {"X-Claude-Code-Session-Id": session}
    messages: list[dict[str, Any]] = [dict(m) for m in body["messages"]]
    sent = []
    for turn, cch in enumerate(("a1b2c", "d3e4f", "0a9b8", "77c0d", "5e6f7")):
        system = [{"type": "text", "text": BILLING.format(cch)}, {"type": "text", "text": GUIDE * 12}]
        answer, record = post("/v1/messages?beta=true", {**body, "system": system, "messages": messages}, headers)
        sent.append(Sent(record))
        messages += [
            {"role": "assistant", "content": answer["content"] or [{"type": "text", "text": "ok"}]},
            {"role": "user", "content": [{"type": "text", "text": tool_result(turn)}]},
        ]
        if compaction and turn == 1:
            side_system = [{"type": "text", "text": BILLING.format("99aa0")}, {"type": "text", "text": GUIDE * 3}]
            ask = [*messages, {"role": "user", "content": [{"type": "text", "text": "Summarize the conversation."}]}]
            side = {**body, "system": side_system, "messages": ask}
            sent.append(Sent(post("/v1/messages?beta=true", side, headers)[1], aside=True))
    return sent


def _qwen_tool(name: str) -> dict[str, Any]:
    parameters = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
    return {
        "type": "function",
        "function": {"name": name, "description": f"Synthetic {name}.", "parameters": parameters},
    }


def qwen_code(post: Post) -> list[Sent]:
    """Five turns with no session id (the reply echo groups them), each answer sent back as it came (text or tool
    calls); after each of the first two, its memory request (another system prompt, 6 of the 14 tools)."""
    tools = [_qwen_tool(f"tool_{i}") for i in range(14)]
    system = {"role": "system", "content": GUIDE * 12}
    side_system = {"role": "system", "content": "You are a synthetic memory helper. Keep what is worth keeping. " * 8}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Create hello.py that prints hello."}]
    sent = []
    for turn in range(5):
        body = {"model": "local", "max_tokens": 64, "temperature": 0, "messages": [system, *messages], "tools": tools}
        answer, record = post("/p/qwen/v1/chat/completions", body, {})
        sent.append(Sent(record))
        said = answer["choices"][0]["message"]
        calls = said.get("tool_calls") or []
        messages.append(
            {"role": "assistant", "content": said.get("content"), **({"tool_calls": calls} if calls else {})}
        )
        if calls:
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": tool_result(turn)} for c in calls]
        else:
            messages.append({"role": "user", "content": tool_result(turn)})
        if turn < 2:
            memory = {"role": "user", "content": "Save the memories worth keeping."}
            side = {"model": "local", "max_tokens": 8, "messages": [side_system, *messages, memory]}
            side["tools"] = tools[7:13]
            sent.append(Sent(post("/p/qwen/v1/chat/completions", side, {})[1], aside=True))
    return sent


def gemini_cli(post: Post) -> list[Sent]:
    """Three user turns, each after its classifier (a new session each time); two model turns each, the last one's
    prompt sent again (the slot holds it whole)."""
    shapes = SHAPES / "gemini-cli"
    classifier = json.loads((shapes / "classifier.json").read_text())
    first = json.loads((shapes / "first-turn.json").read_text())
    headers = {"User-Agent": GEMINI_UA, "x-goog-api-key": "local"}
    main = copy.deepcopy(first["body"])
    main["systemInstruction"]["parts"][0]["text"] = GUIDE * 12
    main["generationConfig"]["temperature"] = 0
    sent = []
    prompts = ("Create hello.py that prints hello.", "Change hello.py so it prints bye.", "Now add a main guard.")
    for turn, prompt in enumerate(prompts):
        ask = copy.deepcopy(classifier["body"])
        ask["systemInstruction"]["parts"][0]["text"] = CLASSIFIER * 25
        ask["contents"][1]["parts"][0]["text"] = prompt
        ask["generationConfig"]["temperature"] = 0
        sent.append(Sent(post(f"/v1beta/models/{classifier['model']}:generateContent", ask, headers)[1], aside=True))
        if turn:
            main["contents"].append({"role": "user", "parts": [{"text": prompt}]})
        for step in range(2):
            path = f"/v1beta/models/{first['model']}:generateContent"
            answer, record = post(path, main, headers)
            sent.append(Sent(record))
            if step == 1:
                sent.append(Sent(post(path, main, headers)[1]))
            parts = answer["candidates"][0]["content"]["parts"]
            said = [p for p in parts if "text" in p or "functionCall" in p] or [{"text": "ok"}]
            main["contents"] += [
                {"role": "model", "parts": said},
                {"role": "user", "parts": [{"text": tool_result(turn * 2 + step)}]},
            ]
    return sent
