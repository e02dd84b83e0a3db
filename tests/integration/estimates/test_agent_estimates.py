"""The proxy's estimate of what a follow-up turn makes llama-server prefill (`new_tokens_est`) against llama-server's
own `prompt_n`, on the real Qwen2.5-Coder-0.5B behind `adaptive-spec serve` (the tiny model's template renders no
tools, so only a real one says how far off an estimate is): Claude Code's turns, whose billing line changes its value
every request, and Qwen Code's, which name no session, with its background request after each turn."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes.servers import ProxyProcess

SHAPES = Path(__file__).resolve().parents[2] / "data" / "agent-shapes"
ESTIMATE_ERROR = 0.15  # of prompt_n, on a turn that continues its session's cached prefix
BILLING = "x-anthropic-billing-header: cc_version=2.1.328.abc; cc_entrypoint=cli; cch={};"
GUIDE = "You are a synthetic coding agent. Read before you edit, keep answers short, and say what you changed. "


@pytest.fixture(scope="module")
def embedded(qwen_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    state = tmp_path_factory.mktemp("state")
    proxy = ProxyProcess("--threads", "1", "--ctx-size", "8192", env={"ADAPTIVE_SPEC_STATE_DIR": str(state)})
    yield proxy
    proxy.stop()


def _post(proxy: ProxyProcess, path: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[Any, dict[str, Any]]:
    """The answer and the request's record."""
    req = urllib.request.Request(
        proxy.base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **headers}
    )
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            answer = json.loads(resp.read())
            request_id = resp.headers["x-adaptive-spec-request-id"]
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{exc.code}: {exc.read()[:500]!r}") from exc
    return answer, next(r for r in proxy.requests() if r["request_id"] == request_id)


def _result(turn: int) -> str:
    """A tool result of a few hundred tokens, different each turn: a file read back, numbered as agents show it."""
    lines = []
    for i in range(6):
        lines += [
            f"def step_{turn}_{i}(items, limit={i + turn}):",
            f'    """Return the first {i + turn} items of the list, each one checked."""',
            "    return [item for item in items[:limit] if item is not None]",
            "",
        ]
    return "".join(f"{n + 1:4d}\t{line}\n" for n, line in enumerate(lines))


def _off(records: list[dict[str, Any]], error: float = ESTIMATE_ERROR) -> list[tuple[int, int]]:
    return [
        (r["new_tokens_est"], r["timings"]["prompt_n"])
        for r in records
        if abs(r["new_tokens_est"] - r["timings"]["prompt_n"]) > error * r["timings"]["prompt_n"]
    ]


# The first follow-up has only the first prompt's characters per token to go on (prose and tool schemas); a tool
# result of code is denser. From the second on, the session's own ratio of prefilled to estimated tokens is learned.
FIRST_FOLLOW_UP_ERROR = 0.4


def test_claude_codes_follow_up_turns_are_estimated_within_15_percent(embedded: ProxyProcess) -> None:
    body = json.loads((SHAPES / "claude-code-messages.json").read_text())
    headers = {"X-Claude-Code-Session-Id": "cc-estimates"}
    messages: list[dict[str, Any]] = [dict(m) for m in body["messages"]]
    records = []
    for turn, cch in enumerate(("a1b2c", "d3e4f", "0a9b8", "77c0d", "5e6f7")):
        system = [{"type": "text", "text": BILLING.format(cch)}, {"type": "text", "text": GUIDE * 12}]
        answer, record = _post(
            embedded, "/v1/messages?beta=true", {**body, "system": system, "messages": messages}, headers
        )
        records.append(record)
        messages += [
            {"role": "assistant", "content": answer["content"] or [{"type": "text", "text": "ok"}]},
            {"role": "user", "content": [{"type": "text", "text": _result(turn)}]},
        ]
    assert {r["session_id"] for r in records} == {"cc-estimates"} and not any(r["side"] for r in records)
    follow_ups = records[1:]
    assert all(r["timings"]["cache_n"] >= records[0]["timings"]["prompt_n"] - 8 for r in follow_ups), records
    estimates = [(r["new_tokens_est"], r["timings"]["prompt_n"]) for r in follow_ups]
    assert _off(follow_ups[:1], FIRST_FOLLOW_UP_ERROR) == [], estimates
    assert _off(follow_ups[1:]) == [], estimates


def _qwen_tool(name: str) -> dict[str, Any]:
    parameters = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
    return {
        "type": "function",
        "function": {"name": name, "description": f"Synthetic {name}.", "parameters": parameters},
    }


def test_qwen_codes_follow_up_turns_are_estimated_within_15_percent(embedded: ProxyProcess) -> None:
    """No session header: the reply echo groups the turns; the background request after each turn (another system
    prompt, 6 of the 14 tools) is a side request and does not count as a turn."""
    tools = [_qwen_tool(f"tool_{i}") for i in range(14)]
    system = {"role": "system", "content": GUIDE * 12}
    side_system = {"role": "system", "content": "You are a synthetic memory helper. Keep what is worth keeping. " * 8}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Create hello.py that prints hello."}]
    records, sides = [], []
    for turn in range(5):
        body = {"model": "local", "max_tokens": 64, "temperature": 0, "messages": [system, *messages], "tools": tools}
        answer, record = _post(embedded, "/p/qwen/v1/chat/completions", body, {})
        records.append(record)
        said = answer["choices"][0]["message"]  # sent back as it came: text, or tool calls
        calls = said.get("tool_calls") or []
        messages.append(
            {"role": "assistant", "content": said.get("content"), **({"tool_calls": calls} if calls else {})}
        )
        if calls:
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": _result(turn)} for c in calls]
        else:
            messages.append({"role": "user", "content": _result(turn)})
        if turn < 2:  # its memory request, after the turn
            memory = {"role": "user", "content": "Save the memories worth keeping."}
            side = {
                "model": "local",
                "max_tokens": 8,
                "messages": [side_system, *messages, memory],
                "tools": tools[7:13],
            }
            sides.append(_post(embedded, "/p/qwen/v1/chat/completions", side, {})[1])
    assert len({r["session_id"] for r in records + sides}) == 1, [
        (r["session_id"], r["session_source"]) for r in records
    ]
    assert [r["side"] for r in sides] == [True, True] and not any(r["side"] for r in records)
    follow_ups = records[1:]
    estimates = [(r["new_tokens_est"], r["timings"]["prompt_n"], r["timings"]["cache_n"]) for r in follow_ups]
    assert _off(follow_ups[:1], FIRST_FOLLOW_UP_ERROR) == [], estimates
    assert _off(follow_ups[1:]) == [], estimates
