"""Never stricter than llama-server, where it matters most: full-size agent bodies (a long system prompt and a
tool list of an agent's size, built from the synthetic shapes of tests/data/agent-shapes/) through `serve` as a user
starts it on the embedded Qwen (its own launched llama-server, the Qwen tools template, every profile's injected
speculation fields), and the same bodies sent to that llama-server directly. The status and the answer's shape must
be the same; not the text: injected speculation may change greedy text on a CPU.

The tiny-model differential (test_agent_shapes.py) runs on an attached plain profile; this one runs the path an agent
takes on a fresh install."""

from __future__ import annotations

import copy
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes.servers import ProxyProcess, http_json

SHAPES = Path(__file__).resolve().parents[3] / "tests" / "data" / "agent-shapes"
# One of each API and agent family; the bodies grow to about 1,500 prompt tokens each (a minute of prefill here).
FULL_SIZE = {
    "claude-code-messages-stream": "/v1/messages?beta=true",
    "qwen-code-chat": "/v1/chat/completions",
    "opencode-chat-stream": "/v1/chat/completions",
    "codex-responses-stream": "/v1/responses",
    "pi-chat-stream": "/v1/chat/completions",
}
_TOOLS = 14
_RULES = 40


def _rules() -> str:
    return "\n".join(
        f"- Rule {i}: read file_{i}.py before editing it, keep each change small, and run the tests after it."
        for i in range(_RULES)
    )


def _schema(i: int) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": f"The file tool_{i} acts on, relative to the workspace."},
            "limit": {"type": "integer", "minimum": 1, "maximum": 2000},
            "mode": {"type": "string", "enum": ["read", "write", "append"]},
        },
        "required": ["path"],
        "additionalProperties": False,
    }


def full_size(name: str, body: dict[str, Any]) -> dict[str, Any]:
    """The shape at an agent's size: its system text followed by the rules, and its tools list grown to `_TOOLS` in
    its own API's tool form."""
    out = copy.deepcopy(body)
    (cap,) = [k for k in ("max_tokens", "max_completion_tokens", "max_output_tokens") if k in out]
    out[cap] = 4  # the field the agent sends
    if name.startswith("claude-code"):
        out["system"] = [*out.get("system", []), {"type": "text", "text": _rules()}]
        out["tools"] = [
            {"name": f"tool_{i}", "description": f"Synthetic tool {i}.", "input_schema": _schema(i)}
            for i in range(_TOOLS)
        ]
    elif name.startswith("codex"):
        out["instructions"] = str(out.get("instructions", "")) + "\n" + _rules()
        out["tools"] = [
            {"type": "function", "name": f"tool_{i}", "description": f"Synthetic tool {i}.", "parameters": _schema(i)}
            for i in range(_TOOLS)
        ]
    else:
        system = out["messages"][0]
        assert system["role"] == "system", name
        system["content"] = str(system["content"]) + "\n" + _rules()
        out["tools"] = [
            {
                "type": "function",
                "function": {"name": f"tool_{i}", "description": f"Synthetic tool {i}.", "parameters": _schema(i)},
            }
            for i in range(_TOOLS)
        ]
    return out


def _post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def shape(raw: bytes, streamed: bool) -> Any:
    """What an answer is made of, without its text: the keys of a JSON answer (and of its first choice or its
    content blocks' types), or a stream's event kinds and whether it ended as its API ends one."""
    if not streamed:
        answer = json.loads(raw)
        if "choices" in answer:
            return ("chat", sorted(answer), answer["choices"][0]["message"]["role"])
        if "content" in answer:
            return ("messages", sorted(answer), answer["type"], answer["role"])
        return ("responses", sorted(answer), answer.get("status"))
    events = set()
    for line in raw.decode(errors="replace").splitlines():
        if line.startswith("event: "):
            events.add(line[7:].strip())
        elif line.startswith("data: ") and line != "data: [DONE]":
            data = json.loads(line[6:])
            events.add(str(data.get("object") or data.get("type")))
    ended = any(end in raw for end in (b"data: [DONE]", b"message_stop", b"response.completed"))
    # Text deltas, usage chunks and timings depend on what was generated: the kinds that always come.
    always = {"message_start", "message_stop", "chat.completion.chunk", "response.created", "response.completed"}
    return sorted(events & always), ended


@pytest.fixture(scope="module")
def launched(qwen_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ProxyProcess, str]]:
    home = tmp_path_factory.mktemp("launched")
    env = {"ADAPTIVE_SPEC_STATE_DIR": str(home / "state"), "ADAPTIVE_SPEC_CONFIG_DIR": str(home / "config")}
    proxy = ProxyProcess(
        *("--model", "embedded:qwen2.5-coder-0.5b", "--threads", "1", "--ctx-size", "8192", "--parallel", "1"),
        *("--no-heads", "--tokenizer", "off"),
        env=env,
    )
    try:
        (server,) = {p["base_url"] for p in http_json(proxy.base + "/adaptive/profiles")["profiles"]}
        yield proxy, server
    finally:
        proxy.stop()


@pytest.mark.parametrize("name", list(FULL_SIZE))
def test_a_full_size_agent_body_through_serve_is_answered_as_its_llama_server_answers_it(
    launched: tuple[ProxyProcess, str], name: str
) -> None:
    proxy, server = launched
    body = full_size(name, json.loads((SHAPES / f"{name}.json").read_text()))
    path = FULL_SIZE[name]
    direct_status, direct = _post(server + path, body)  # first: the proxy's request then reuses the prefill
    status, through = _post(proxy.base + path, body)
    record = proxy.requests()[-1]
    assert status == 200, through[:300]
    if direct_status != 200:  # Codex's call-less tool output, which llama-server refuses: the proxy's repair takes it
        assert direct_status == 400 and record["repaired"], (direct[:300], record)
    else:
        assert shape(through, bool(body.get("stream"))) == shape(direct, bool(body.get("stream"))), (through, direct)
    # Served on a launched profile, with its speculation fields, over a prompt of an agent's size.
    assert record["profile"] in {p["name"] for p in http_json(proxy.base + "/adaptive/profiles")["profiles"]}
    assert record["speculation"] is not None, record
    assert record["timings"]["prompt_n"] + record["timings"]["cache_n"] >= 1000, record
