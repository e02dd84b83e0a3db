"""Real agents' request bodies grown into long sessions, for the overhead benchmarks.

The recorded requests (a directory of `<agent>.jsonl` files, one HTTP request a line with its `path`, `headers` and
`body`; passed on the command line, never copied here) reach ~10k tokens. Each agent's last recorded main request is
grown turn by turn the way a coding agent's history grows: a tool call that reads a file and the file as the tool's
result (chat `tool_calls` + a `tool` message; Responses `function_call` + `function_call_output`; for a client without
tools, the file pasted in a user message and a short assistant reply). The files are synthetic source code, seeded,
so every run sends the same bytes.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Tokens per character of the synthetic files (o200k on this generator's output) and of JSON bodies in general: used
# only to size the growth; the benchmarks report the sizes they measured.
CHARS_PER_TOKEN = 3.6
AGENTS = ("opencode", "codex", "llm", "openai_sdk")
_WORDS = ("value", "index", "result", "buffer", "config", "parser", "session", "request", "handler", "stream")


@dataclass(frozen=True)
class AgentRequest:
    agent: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


def load(fixtures: Path) -> dict[str, AgentRequest]:
    """Each agent's largest recorded main request (its path, headers and body)."""
    out: dict[str, AgentRequest] = {}
    for agent in AGENTS:
        file = fixtures / f"{agent}.jsonl"
        if not file.exists():
            continue
        best: AgentRequest | None = None
        for line in file.read_text().splitlines():
            record = json.loads(line)
            body = record.get("body")
            if not isinstance(body, dict) or record.get("truth", {}).get("kind") != "main":
                continue
            headers = {str(k): str(v) for k, v in (record.get("headers") or {}).items()}
            candidate = AgentRequest(agent, str(record["path"]), headers, body)
            if best is None or len(json.dumps(body)) > len(json.dumps(best.body)):
                best = candidate
        if best is not None:
            out[agent] = best
    return out


def synthetic_file(rng: random.Random, chars: int) -> str:
    """Python-looking source of about `chars` characters."""
    lines: list[str] = []
    size = 0
    n = 0
    while size < chars:
        a, b = rng.choice(_WORDS), rng.choice(_WORDS)
        block = (
            f"def {a}_{b}_{n}({a}, {b}=None):\n"
            f'    """Return the {a} of the {b} ({rng.randrange(10_000)})."""\n'
            f"    if {b} is None:\n        {b} = {rng.randrange(1000)}\n"
            f"    return {a} * {rng.randrange(97)} + len(str({b}))\n\n"
        )
        lines.append(block)
        size += len(block)
        n += 1
    return "".join(lines)[:chars]


def _messages(body: dict[str, Any]) -> list[Any]:
    key = "input" if "input" in body else "messages"
    if isinstance(body.get(key), str):
        body[key] = [{"role": "user", "content": body[key]}]
    items = body.setdefault(key, [])
    assert isinstance(items, list)
    return items


def add_turn(
    body: dict[str, Any], turn: int, file_chars: int, *, responses: bool, seed: int = 0
) -> tuple[str, list[str]]:
    """Append one turn that reads a file (in place). Returns what the proxy served for it: (text, tool-call ids)."""
    rng = random.Random(seed * 1_000_003 + turn)
    text = synthetic_file(rng, file_chars)
    call_id = f"call_{seed}_{turn:04d}"
    path = f"src/module_{turn}.py"
    items = _messages(body)
    if responses:
        arguments = json.dumps({"command": ["cat", path]})
        items.append({"type": "function_call", "call_id": call_id, "name": "shell", "arguments": arguments})
        items.append({"type": "function_call_output", "call_id": call_id, "output": text})
        return "", [call_id]
    if body.get("tools"):
        arguments = json.dumps({"filePath": path})
        call = {"id": call_id, "type": "function", "function": {"name": "read", "arguments": arguments}}
        items.append({"role": "assistant", "content": "", "tool_calls": [call]})
        items.append({"role": "tool", "tool_call_id": call_id, "content": text})
        return "", [call_id]
    # A client without tools: a text reply, then the file pasted in the user's next message.
    reply = f"Here is what {path} does, turn {turn}: it defines {text.count('def ')} small functions."
    items.append({"role": "assistant", "content": reply})
    items.append({"role": "user", "content": f"Now read {path}:\n\n{text}"})
    return reply, []


def grown(request: AgentRequest, tokens: int, *, file_tokens: int = 6000, seed: int = 0) -> tuple[dict[str, Any], int]:
    """The agent's body grown with file-reading turns to about `tokens` tokens; returns (body, turns added)."""
    body = copy.deepcopy(request.body)
    responses = "input" in body
    turn = 0
    while len(json.dumps(body)) / CHARS_PER_TOKEN < tokens:
        left = tokens * CHARS_PER_TOKEN - len(json.dumps(body))
        add_turn(body, turn, int(min(file_tokens * CHARS_PER_TOKEN, max(400, left))), responses=responses, seed=seed)
        turn += 1
    return body, turn


def next_turn(
    body: dict[str, Any], turn: int, *, file_tokens: int = 500, seed: int = 0
) -> tuple[dict[str, Any], tuple[str, list[str]]]:
    """The next request of the session: the body plus one more (small) file-reading turn; and what the proxy served
    for the previous request (text, tool-call ids), which the new turn carries back."""
    out = copy.deepcopy(body)
    served = add_turn(out, turn, int(file_tokens * CHARS_PER_TOKEN), responses="input" in out, seed=seed)
    return out, served
