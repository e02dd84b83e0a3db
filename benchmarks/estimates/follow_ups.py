"""Follow-up estimates of agent-shaped sessions on the embedded 0.5B: the proxy's `new_tokens_est` against
llama-server's `prompt_n`, per agent.

`adaptive-spec serve` (one slot, `--threads 1`, heads and llama-server's RAM prompt cache as `serve` leaves them)
replays three synthetic sessions of the shapes the agents send (tests/data/agent-shapes/: no agent's own text):
Claude Code's (`/v1/messages`, its billing line changing each request, a compaction-like side request after the
second turn), Qwen Code's (chat, 14 tools, no session id, its memory side request after each of the first turns) and
Gemini CLI's (its model router's classifier before each user turn, a new session each time, then two model turns and
the last one's prompt sent again). Every request after the conversation's first turn counts, side requests and
later classifiers included.

    python -m benchmarks.estimates.follow_ups [--out FILE]

Run it against another tree with that tree first on PYTHONPATH (`serve` runs from it): the before and after of a
change.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.processes.servers import ProxyProcess

SHAPES = Path(__file__).resolve().parents[2] / "tests" / "data" / "agent-shapes"
GUIDE = "You are a synthetic coding agent. Read before you edit, keep answers short, and say what you changed. "
CLASSIFIER = "Score how hard the request is, from 1 to 100, and say why, in JSON, weighing the files it names. "
BILLING = "x-anthropic-billing-header: cc_version=2.1.332.abc; cc_entrypoint=cli; cch={};"
GEMINI_UA = "GeminiCLI/0.61.0/gemini-3.1-pro-preview (linux; x64)"
ERROR = 0.15

Post = Callable[[str, dict[str, Any], dict[str, str]], tuple[Any, dict[str, Any]]]


def _poster(proxy: ProxyProcess) -> Post:
    def post(path: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[Any, dict[str, Any]]:
        req = urllib.request.Request(
            proxy.base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **headers}
        )
        with urllib.request.urlopen(req, timeout=1800) as resp:
            answer = json.loads(resp.read())
            request_id = resp.headers["x-adaptive-spec-request-id"]
        return answer, next(r for r in proxy.requests() if r["request_id"] == request_id)

    return post


def _result(turn: int) -> str:
    """A tool result of code, different each turn, numbered as agents show a file."""
    lines = []
    for i in range(6):
        lines += [
            f"def step_{turn}_{i}(items, limit={i + turn}):",
            f'    """Return the first {i + turn} items of the list, each one checked."""',
            "    return [item for item in items[:limit] if item is not None]",
            "",
        ]
    return "".join(f"{n + 1:4d}\t{line}\n" for n, line in enumerate(lines))


def claude_code(post: Post) -> list[dict[str, Any]]:
    body = json.loads((SHAPES / "claude-code-messages.json").read_text())
    headers = {"X-Claude-Code-Session-Id": "cc-follow-ups"}
    messages: list[dict[str, Any]] = [dict(m) for m in body["messages"]]
    records = []
    for turn, cch in enumerate(("a1b2c", "d3e4f", "0a9b8", "77c0d", "5e6f7")):
        system = [{"type": "text", "text": BILLING.format(cch)}, {"type": "text", "text": GUIDE * 12}]
        answer, record = post("/v1/messages?beta=true", {**body, "system": system, "messages": messages}, headers)
        records.append(record)
        messages += [
            {"role": "assistant", "content": answer["content"] or [{"type": "text", "text": "ok"}]},
            {"role": "user", "content": [{"type": "text", "text": _result(turn)}]},
        ]
        if turn == 1:  # a side request of its own system prompt (its compaction's shape)
            side_system = [{"type": "text", "text": BILLING.format("99aa0")}, {"type": "text", "text": GUIDE * 3}]
            ask = [*messages, {"role": "user", "content": [{"type": "text", "text": "Summarize the conversation."}]}]
            records.append(post("/v1/messages?beta=true", {**body, "system": side_system, "messages": ask}, headers)[1])
    return records


def qwen_code(post: Post) -> list[dict[str, Any]]:
    schema = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
    tools = [
        {
            "type": "function",
            "function": {"name": f"tool_{i}", "description": f"Synthetic tool_{i}.", "parameters": schema},
        }
        for i in range(14)
    ]
    system = {"role": "system", "content": GUIDE * 12}
    side_system = {"role": "system", "content": "You are a synthetic memory helper. Keep what is worth keeping. " * 8}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Create hello.py that prints hello."}]
    records = []
    for turn in range(5):
        body = {"model": "local", "max_tokens": 64, "temperature": 0, "messages": [system, *messages], "tools": tools}
        answer, record = post("/p/qwen/v1/chat/completions", body, {})
        records.append(record)
        said = answer["choices"][0]["message"]
        calls = said.get("tool_calls") or []
        messages.append(
            {"role": "assistant", "content": said.get("content"), **({"tool_calls": calls} if calls else {})}
        )
        if calls:
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": _result(turn)} for c in calls]
        else:
            messages.append({"role": "user", "content": _result(turn)})
        if turn < 2:
            memory = {"role": "user", "content": "Save the memories worth keeping."}
            side = {
                "model": "local",
                "max_tokens": 8,
                "messages": [side_system, *messages, memory],
                "tools": tools[7:13],
            }
            records.append(post("/p/qwen/v1/chat/completions", side, {})[1])
    return records


def gemini_cli(post: Post) -> list[dict[str, Any]]:
    shapes = SHAPES / "gemini-cli"
    classifier = json.loads((shapes / "classifier.json").read_text())
    first = json.loads((shapes / "first-turn.json").read_text())
    headers = {"User-Agent": GEMINI_UA, "x-goog-api-key": "local"}
    main = copy.deepcopy(first["body"])
    main["systemInstruction"]["parts"][0]["text"] = GUIDE * 12
    main["generationConfig"]["temperature"] = 0
    records = []
    prompts = ("Create hello.py that prints hello.", "Change hello.py so it prints bye.", "Now add a main guard.")
    for turn, prompt in enumerate(prompts):
        ask = copy.deepcopy(classifier["body"])
        ask["systemInstruction"]["parts"][0]["text"] = CLASSIFIER * 25
        ask["contents"][1]["parts"][0]["text"] = prompt
        ask["generationConfig"]["temperature"] = 0
        records.append(post(f"/v1beta/models/{classifier['model']}:generateContent", ask, headers)[1])
        if turn:
            main["contents"].append({"role": "user", "parts": [{"text": prompt}]})
        for step in range(2):
            path = f"/v1beta/models/{first['model']}:generateContent"
            answer, record = post(path, main, headers)
            records.append(record)
            if step == 1:  # the same prompt again: the slot holds it whole
                records.append(post(path, main, headers)[1])
            parts = answer["candidates"][0]["content"]["parts"]
            said = [p for p in parts if "text" in p or "functionCall" in p] or [{"text": "ok"}]
            main["contents"] += [
                {"role": "model", "parts": said},
                {"role": "user", "parts": [{"text": _result(turn * 2 + step)}]},
            ]
    return records


FIRST_TURN = {"Gemini CLI": 1}  # the conversation's first turn comes after its classifier
AGENTS: dict[str, Callable[[Post], list[dict[str, Any]]]] = {
    "Claude Code": claude_code,
    "Qwen Code": qwen_code,
    "Gemini CLI": gemini_cli,
}


def summary(records: list[dict[str, Any]], first: int = 0) -> dict[str, Any]:
    """Every request after the conversation's first turn (`first`: its index; Gemini CLI's classifier comes before
    it): (estimate, prompt_n, cache_n, side), the median error and how many are within 15% of prompt_n."""
    rows = [
        (r["new_tokens_est"], r["timings"]["prompt_n"], r["timings"]["cache_n"], bool(r["side"]))
        for r in records[first + 1 :]
        if r.get("timings") and r.get("new_tokens_est") is not None
    ]
    errors = [abs(est - n) / n for est, n, _, _ in rows]
    return {
        "follow_ups": len(rows),
        "median_error": round(statistics.median(errors), 4) if errors else None,
        "within_15": sum(e <= ERROR for e in errors),
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--agents", default=",".join(AGENTS))
    args = parser.parse_args(argv)
    out: dict[str, Any] = {}
    for name in args.agents.split(","):
        state = tempfile.mkdtemp(prefix="follow-ups-")
        proxy = ProxyProcess("--threads", "1", "--ctx-size", "8192", env={"ADAPTIVE_SPEC_STATE_DIR": state})
        t0 = time.monotonic()
        try:
            records = AGENTS[name](_poster(proxy))
        finally:
            proxy.stop()
        out[name] = {**summary(records, FIRST_TURN.get(name, 0)), "wall_s": round(time.monotonic() - t0, 1)}
        s = out[name]
        print(f"{name}: {s['follow_ups']} follow-ups, median error {s['median_error']}, {s['within_15']} within 15%")
        print("   (est, prompt_n, cache_n, side): " + ", ".join(map(str, s["rows"])), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
