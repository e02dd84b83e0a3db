"""Warm starts: agents' first turns through a running `serve`, for three agent shapes (opencode, Claude Code, Qwen Code;
synthetic bodies of their shape and size), in seven cases: cold (an empty store), a new session in the same project,
a new session after a side request took the one slot, another project, a project seen before, after `serve` restarts
and after its llama-server is SIGKILLed and restarted by `serve`. Each first turn's time to first token, prompt_n,
cache_n, the router's new-token estimate and the route's reason (which says "warm: head of N tokens restored in
X ms") come from the proxy's own request records; the store's heads (tokens, bytes) from `/adaptive/heads`. Written
to a JSON file and printed as a markdown table.

Run:  .venv/bin/python -m benchmarks.warm_starts.restarts [--model embedded:qwen2.5-coder-0.5b] [--out FILE.json]
      [--agents opencode,claude-code,qwen-code] [--no-heads] (the same cases without the store, llama-server's own
      RAM prompt cache alone; the restart and crash cases are skipped there: they are cold by construction)
      [--scenario two-at-once] two new sessions of one agent start together on a server of two slots, after a first
      one left its head in the store and both slots were emptied
      [--scenario resume] a conversation's third turn after `serve` restarted, its second turn having been kept as
      the session's state once it was idle (`[heads] session_idle_s`, 30 s)

No vendor's prompt is used: system prompts and tools are generated text of each agent's measured size (opencode
~7.2k tokens and 12 tools, its working directory before the tools; Claude Code ~11.7k and 12 tools, the working
directory in a system message after the first user message; Qwen Code ~15.3k and 14 tools, the working directory in
the user message). Greedy, one slot, `-t 1` unless told otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.processes.servers import ProxyProcess, llama_children

from benchmarks.harness import ROOT, results

NAME = "benchmarks.warm_starts.restarts"  # the result file's `benchmark`
_RULES = ("Prefer", "Never", "Always", "Before you", "When the user asks,", "If a tool fails,")
_ACTS = ("edit a file", "run the tests", "read the file", "explain a change", "commit", "search the code")
_WORDS = ("path", "pattern", "offset", "limit", "content", "command")


@dataclass(frozen=True)
class Shape:
    """An agent's first request: its API, system lines and tools (sizes fitted to the measured token counts)."""

    name: str
    api: str  # "openai" or "anthropic"
    user_agent: str
    lines: int
    tools: int
    tool_words: int


SHAPES = {
    "opencode": Shape("opencode", "openai", "opencode/1.0.0", 80, 12, 60),
    "claude-code": Shape("claude-code", "anthropic", "claude-cli/2.1.328 (external, cli)", 150, 12, 105),
    "qwen-code": Shape("qwen-code", "openai", "QwenCode/0.24.4 (linux; x64)", 190, 14, 110),
}


def _rules(rng: random.Random, count: int) -> list[str]:
    return [
        f"{rng.choice(_RULES)} {rng.choice(_ACTS)}, keep answers short and name the files you touch "
        f"(rule {i}: {' '.join(rng.choice(('small', 'typed', 'tested', 'clear', 'safe')) for _ in range(6))})."
        for i in range(count)
    ]


def _tools(rng: random.Random, shape: Shape) -> list[dict[str, Any]]:
    out = []
    for i in range(shape.tools):
        words = " ".join(rng.choice(_WORDS) for _ in range(shape.tool_words))
        params = {
            f"arg_{j}": {"type": "string", "description": f"Argument {j} of tool {i}: {words[: 120 + 20 * j]}"}
            for j in range(6)
        }
        schema = {"type": "object", "properties": params, "required": ["arg_0"]}
        if shape.api == "anthropic":
            out.append({"name": f"Tool{i}", "description": f"Tool {i}. {words}", "input_schema": schema})
        else:
            desc = f"Tool {i}. {words}"
            out.append(
                {"type": "function", "function": {"name": f"tool_{i}", "description": desc, "parameters": schema}}
            )
    return out


def first_body(shape: Shape, project: str, user: str, session: str) -> dict[str, Any]:
    """The agent's first turn in `project`: the same head for every session of a project."""
    rng = random.Random(shape.name)
    intro = f"You are {shape.name}, an interactive CLI coding agent. Use the instructions below and the tools."
    rules, tools = "\n".join(_rules(rng, shape.lines)), _tools(rng, shape)
    common = {"model": "m", "stream": True, "max_tokens": 8, "temperature": 0}
    if shape.name == "opencode":  # the working directory before the tools
        system = f"{intro}\nWorking directory: {project}\nIs directory a git repo: yes. Platform: linux.\n{rules}"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        return {**common, "messages": messages, "tools": tools}
    if shape.api == "anthropic":  # the working directory in a system message after the first user message
        blocks: list[dict[str, Any]] = [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328; cc_entrypoint=cli;"}
        ]
        blocks.append({"type": "text", "text": f"{intro}\n{rules}", "cache_control": {"type": "ephemeral"}})
        turns = [
            {"role": "user", "content": [{"type": "text", "text": "<reminder>Use the tools.</reminder>"}]},
            {"role": "system", "content": f"<env>Working directory: {project}\nPlatform: linux</env>"},
            {"role": "user", "content": [{"type": "text", "text": user}]},
        ]
        meta = {"user_id": json.dumps({"device_id": "bench", "session_id": session})}
        return {**common, "system": blocks, "messages": turns, "tools": tools, "metadata": meta}
    env = {"type": "text", "text": f"<env>Working directory: {project}\nPlatform: linux</env>"}  # Qwen Code
    user_parts = [env, {"type": "text", "text": user}]
    qwen: list[dict[str, Any]] = [
        {"role": "system", "content": f"{intro}\n{rules}"},
        {"role": "user", "content": user_parts},
    ]
    return {**common, "messages": qwen, "tools": tools}


def side_body() -> dict[str, Any]:
    """A title request: another, short system prompt and no tools (on one slot it takes the session's slot)."""
    system = "Generate a short title for the conversation below. Answer with the title only, at most eight words."
    user = "Add a /health endpoint to the server and a test for it."
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return {"model": "m", "stream": True, "max_tokens": 8, "temperature": 0, "messages": messages}


class Serve(ProxyProcess):
    """`serve` on the state directory `state` (its head store in heads/ there), one slot, the tests' own starter."""

    def __init__(self, model: str, state: Path, threads: int, extra: list[str], parallel: int = 1) -> None:
        ctx = str(32768 * parallel)
        args = ("--model", model, "--threads", str(threads), "--parallel", str(parallel), "--ctx-size", ctx, *extra)
        super().__init__(*args, env={"ADAPTIVE_SPEC_STATE_DIR": str(state)}, ready_timeout=1800.0)
        for line in self.lines:
            if "heads:" in line or "warm" in line:
                print("  serve:", line, flush=True)

    @property
    def lines(self) -> list[str]:
        return self.stdout_lines + self.stderr_lines

    def get(self, path: str) -> dict[str, Any]:
        with urllib.request.urlopen(self.base + path, timeout=60) as resp:
            return dict(json.loads(resp.read()))

    def send(self, shape: Shape, session: str, data: dict[str, Any]) -> dict[str, Any]:
        """One streamed request; its record (timings, ttft_ms, new_tokens_est, reason) once the proxy kept it."""
        path = "/v1/messages" if "system" in data and shape.api == "anthropic" else "/v1/chat/completions"
        headers = {"Content-Type": "application/json", "x-session-id": session, "User-Agent": shape.user_agent}
        req = urllib.request.Request(self.base + path, data=json.dumps(data).encode(), headers=headers)
        with urllib.request.urlopen(req, timeout=3600) as resp:
            request_id = resp.headers["x-adaptive-spec-request-id"]
            for _ in resp:
                pass
        for _ in range(200):
            found = [r for r in self.get("/adaptive/requests")["requests"] if r["request_id"] == request_id]
            if found:
                return summary(found[0])
            time.sleep(0.05)
        raise SystemExit(f"no record of {request_id}")

    def settle(self, timeout_s: float = 120.0) -> None:
        """Wait until the store has no save under way (the count of finished saves stops moving while idle)."""
        if not self.get("/adaptive/heads").get("enabled"):
            return
        deadline, last = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            heads = self.get("/adaptive/heads")
            if heads["counts"] == last and not heads.get("pending"):
                return
            last = heads["counts"]
            time.sleep(1.0)

    def erase_all(self) -> None:
        """Every slot emptied (through the proxy, so its router knows)."""
        for name in self.get("/adaptive/health")["profiles"]:
            url, headers = f"{self.base}/adaptive/profiles/{name}/erase", {"Content-Type": "application/json"}
            req = urllib.request.Request(url, data=b"{}", headers=headers, method="POST")
            with urllib.request.urlopen(req, timeout=60):
                pass

    def llama_pid(self) -> int:
        pids = llama_children(self)
        if not pids:
            raise SystemExit("no llama-server under serve")
        return min(pids)

    def crash(self) -> float:
        """SIGKILL the llama-server; the seconds until `serve` has it serving again."""
        t0 = time.monotonic()
        os.kill(self.llama_pid(), signal.SIGKILL)
        time.sleep(0.5)
        while time.monotonic() - t0 < 300:
            try:
                health = self.get("/adaptive/health")["profiles"]
                if all(p["up"] for p in health.values()):
                    return round(time.monotonic() - t0, 2)
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.2)
        raise SystemExit("llama-server did not come back")


def summary(record: dict[str, Any]) -> dict[str, Any]:
    t = record.get("timings") or {}
    return {
        "ttft_s": round((record.get("ttft_ms") or record.get("total_ms") or 0) / 1000.0, 3),
        "prompt_n": t.get("prompt_n"),
        "cache_n": t.get("cache_n"),
        "new_tokens_est": record.get("new_tokens_est"),
        "side": record.get("side"),
        "reason": record.get("reason"),
    }


def run_agent(serve: Serve, shape: Shape, tag: str) -> dict[str, Any]:
    """The in-run cases for one agent: cold, same project, after a side request, another project, seen before."""
    p1, p2 = "/home/dev/projects/shop", "/home/dev/projects/blog"
    out: dict[str, Any] = {}

    def first(case: str, session: str, project: str, user: str) -> None:
        out[case] = serve.send(shape, session, first_body(shape, project, user, session))
        print(f"{shape.name} {case}:", out[case], flush=True)
        serve.settle()

    first("cold", f"{tag}-a", p1, "Add a /health endpoint to the server.")
    first("new_session_same_project", f"{tag}-b", p1, "Fix the failing test.")
    out["side_request"] = serve.send(shape, f"{tag}-b", side_body())
    print(f"{shape.name} side request:", out["side_request"], flush=True)
    serve.settle()
    first("after_side_request", f"{tag}-c", p1, "Explain the config loader.")
    first("another_project", f"{tag}-d", p2, "Add a /health endpoint to the server.")
    first("project_seen_before", f"{tag}-e", p1, "Rename the config module.")
    return out


def after(serve: Serve, shapes: list[Shape], tag: str, case: str) -> dict[str, Any]:
    out = {}
    for shape in shapes:
        session = f"{tag}-{shape.name}"
        out[shape.name] = serve.send(shape, session, first_body(shape, "/home/dev/projects/shop", "Add docs.", session))
        print(f"{shape.name} {case}:", out[shape.name], flush=True)
        serve.settle()
    return out


def two_at_once(args: argparse.Namespace, shape: Shape, state: Path, extra: list[str]) -> dict[str, Any]:
    """A first session leaves its head; both slots emptied; two new sessions start together."""
    p1 = "/home/dev/projects/shop"
    serve = Serve(args.model, state, args.threads, extra, parallel=2)
    try:
        out: dict[str, Any] = {
            "cold": serve.send(shape, "first", first_body(shape, p1, "Add a /health endpoint.", "first"))
        }
        print(f"{shape.name} cold:", out["cold"], flush=True)
        serve.settle()
        serve.erase_all()
        users = {"one": "Fix the failing test.", "two": "Explain the config loader."}
        with ThreadPoolExecutor(2) as pool:
            sent = {k: pool.submit(serve.send, shape, k, first_body(shape, p1, u, k)) for k, u in users.items()}
            for key, future in sent.items():
                out[f"at_once_{key}"] = future.result()
                print(f"{shape.name} at once ({key}):", out[f"at_once_{key}"], flush=True)
        out["heads"] = serve.get("/adaptive/heads").get("heads", [])  # tokens and bytes of each head kept
        return out
    finally:
        serve.stop()


def resume(args: argparse.Namespace, shape: Shape, state: Path, extra: list[str]) -> dict[str, Any]:
    """Two turns of a conversation, idle until its state is kept, `serve` restarted, then its third turn."""
    p1, session = "/home/dev/projects/shop", "conversation"
    body = first_body(shape, p1, "Add a /health endpoint.", session)
    replies = ("I added the endpoint in server.py.", "The test is in tests/test_health.py.")
    serve = Serve(args.model, state, args.threads, extra)
    out: dict[str, Any] = {}
    try:
        out["turn_1"] = serve.send(shape, session, body)
        body["messages"] += [{"role": "assistant", "content": replies[0]}, {"role": "user", "content": "Add a test."}]
        out["turn_2"] = serve.send(shape, session, body)
        print(f"{shape.name} turns 1, 2:", out["turn_1"], out["turn_2"], flush=True)
        time.sleep(35.0)  # `[heads] session_idle_s` is 30 s by default
        serve.settle()
        out["kept"] = [h for h in serve.get("/adaptive/heads").get("heads", []) if h.get("session")]
    finally:
        serve.stop()
    serve = Serve(args.model, state, args.threads, extra)
    try:
        time.sleep(5.0)
        serve.erase_all()  # the start-up restore may have put the state back already: measure the restore itself
        body["messages"] += [{"role": "assistant", "content": replies[1]}, {"role": "user", "content": "Run it."}]
        out["turn_3_after_restart"] = serve.send(shape, session, body)
        print(f"{shape.name} turn 3 after restart:", out["turn_3_after_restart"], flush=True)
        return out
    finally:
        serve.stop()


def table(runs: dict[str, Any]) -> str:
    rows = ["| agent | case | prompt_n / cache_n | new-token estimate | TTFT | reason |", "|---|---|---|---|---|---|"]
    for agent, cases in runs["agents"].items():
        for case, r in cases.items():
            if not isinstance(r, dict) or "prompt_n" not in r:
                continue  # not a request's record (the kept session states)
            reason = (r.get("reason") or "").split("; ")[-1] if "warm" in (r.get("reason") or "") else ""
            rows.append(
                f"| {agent} | {case} | {r['prompt_n']} / {r['cache_n']} | {r['new_tokens_est']} | {r['ttft_s']} s |"
                f" {reason} |"
            )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", default="embedded:qwen2.5-coder-0.5b")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--agents", default=",".join(SHAPES))
    parser.add_argument("--no-heads", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "warm_starts.json")
    parser.add_argument("--scenario", choices=("cases", "two-at-once", "resume"), default="cases")
    args = parser.parse_args()
    shapes = [SHAPES[name] for name in args.agents.split(",")]
    extra = ["--no-heads"] if args.no_heads else []
    runs: dict[str, Any] = {"model": args.model, "threads": args.threads, "heads": not args.no_heads, "agents": {}}

    def write() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        results.write(args.out, NAME, runs)

    if args.scenario != "cases":
        scenario = two_at_once if args.scenario == "two-at-once" else resume
        runs["scenario"] = args.scenario
        for shape in shapes:
            with tempfile.TemporaryDirectory(prefix="warm-starts-") as state:
                runs["agents"][shape.name] = scenario(args, shape, Path(state), extra)
            write()
        print(table(runs))
        print(f"written to {args.out}")
        return 0

    with tempfile.TemporaryDirectory(prefix="warm-starts-") as state:
        serve = Serve(args.model, Path(state), args.threads, extra)
        try:
            for shape in shapes:
                runs["agents"][shape.name] = run_agent(serve, shape, shape.name)
                write()
            runs["heads"] = serve.get("/adaptive/heads")
        finally:
            serve.stop()
        if not args.no_heads:
            t0 = time.monotonic()
            serve = Serve(args.model, Path(state), args.threads, extra)
            runs["serve_restart_s"] = round(time.monotonic() - t0, 2)
            runs["serve_restart_lines"] = [line for line in serve.lines if "heads" in line or "warm" in line]
            try:
                time.sleep(5.0)  # the start-up restore runs in the background; a request may also come at once
                for name, r in after(serve, shapes, "restart", "after serve restart").items():
                    runs["agents"][name]["after_serve_restart"] = r
                write()
                runs["crash_restart_s"] = serve.crash()
                time.sleep(5.0)
                for name, r in after(serve, shapes, "crash", "after llama-server crash").items():
                    runs["agents"][name]["after_llama_server_crash"] = r
                runs["heads_after"] = serve.get("/adaptive/heads")
            finally:
                serve.stop()
    write()
    print(table(runs))
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
