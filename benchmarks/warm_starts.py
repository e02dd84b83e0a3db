"""Warm starts (issue 40): an opencode-shaped first turn through a running `serve`, cold, as a new session in the
same project, and as a new session after `serve` restarts (a fresh llama-server, the head store kept in the state
directory); printing time to first token, prompt_n and cache_n, and writing them to a JSON file.

Run:  .venv/bin/python benchmarks/warm_starts.py [--model embedded:qwen2.5-coder-0.5b] [--out FILE.json]
      [--no-heads]  (the same three cases without the store: the restart is cold again)

The body is synthetic, of opencode's shape and size (a ~2.5k-token system prompt naming the working directory, 12
tools with JSON schemas, ~7k tokens in all, then one user message); no vendor's prompt is used. Greedy, one slot,
`-t 1` unless told otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
_RULES = ("Prefer", "Never", "Always", "Before you", "When the user asks,", "If a tool fails,")
_ACTS = ("edit a file", "run the tests", "read the file", "explain a change", "commit", "search the code")


def system_prompt(rng: random.Random, project: str, lines: int = 80) -> str:
    head = [
        "You are opencode, an interactive CLI coding agent. Use the instructions below and the tools available.",
        f"Working directory: {project}",
        "Is directory a git repo: yes. Platform: linux.",
    ]
    body = [
        f"{rng.choice(_RULES)} {rng.choice(_ACTS)}, keep answers short and name the files you touch "
        f"(rule {i}: {' '.join(rng.choice(('small', 'typed', 'tested', 'clear', 'safe')) for _ in range(6))})."
        for i in range(lines)
    ]
    return "\n".join(head + body)


def tools(rng: random.Random, count: int = 12) -> list[dict[str, Any]]:
    out = []
    for i in range(count):
        words = " ".join(rng.choice(("path", "pattern", "offset", "limit", "content", "command")) for _ in range(60))
        params = {
            f"arg_{j}": {"type": "string", "description": f"Argument {j} of tool {i}: {words[: 120 + 20 * j]}"}
            for j in range(6)
        }
        out.append(
            {
                "type": "function",
                "function": {
                    "name": f"tool_{i}",
                    "description": f"Tool {i}. {words}",
                    "parameters": {"type": "object", "properties": params, "required": ["arg_0"]},
                },
            }
        )
    return out


def body(project: str, user: str) -> dict[str, Any]:
    rng = random.Random(7)  # the same head for every session of a project
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system_prompt(rng, project)}, {"role": "user", "content": user}],
        "tools": tools(rng),
        "stream": True,
        "max_tokens": 8,
        "temperature": 0,
    }


def first_turn(base: str, session: str, data: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(
        base + "/v1/chat/completions",
        data=json.dumps(data).encode(),
        headers={"Content-Type": "application/json", "x-session-id": session},
    )
    t0 = time.perf_counter()
    ttft_s: float | None = None
    timings: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=1800) as resp:
        request_id = resp.headers["x-adaptive-spec-request-id"]
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            delta = (chunk.get("choices") or [{}])[0].get("delta") or {}
            if ttft_s is None and (delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content")):
                ttft_s = time.perf_counter() - t0
            timings = chunk.get("timings") or timings
    with urllib.request.urlopen(base + "/adaptive/requests", timeout=60) as resp:
        record = next(r for r in json.loads(resp.read())["requests"] if r["request_id"] == request_id)
    return {
        "ttft_s": round(ttft_s if ttft_s is not None else time.perf_counter() - t0, 3),
        "prompt_n": timings.get("prompt_n"),
        "cache_n": timings.get("cache_n"),
        "reason": record.get("reason"),
    }


class Serve:
    def __init__(self, model: str, state: Path, threads: int, extra: list[str]) -> None:
        env = {**os.environ, "ADAPTIVE_SPEC_STATE_DIR": str(state), "PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, "-m", "adaptive_spec", "serve", "--model", model, "--threads", str(threads)]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        argv += ["--parallel", "1", "--ctx-size", "16384", "--port", str(port), *extra]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.base = ""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            print("  serve:", line.rstrip())
            if line.startswith("OPENAI_BASE_URL="):
                self.base = line.strip().split("=", 1)[1].removesuffix("/v1")
                break
        if not self.base:
            raise SystemExit("serve did not start")
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if "heads:" in line or "warm" in line:
                print("  serve:", line.rstrip())

    def heads(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.base + "/adaptive/heads", timeout=60) as resp:
            return dict(json.loads(resp.read()))

    def wait_for_head(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.heads().get("heads") and time.monotonic() < deadline and self.heads().get("enabled"):
            time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded:qwen2.5-coder-0.5b")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-heads", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "warm_starts.json")
    args = parser.parse_args()
    extra = ["--no-heads"] if args.no_heads else []
    project = "/home/dev/projects/shop"
    results: dict[str, Any] = {"model": args.model, "threads": args.threads, "heads": not args.no_heads}
    with tempfile.TemporaryDirectory(prefix="warm-starts-") as state:
        serve = Serve(args.model, Path(state), args.threads, extra)
        try:
            results["cold"] = first_turn(serve.base, "a", body(project, "Add a /health endpoint to the server."))
            print("cold:", results["cold"])
            serve.wait_for_head()
            results["new_session_same_project"] = first_turn(serve.base, "b", body(project, "Fix the failing test."))
            print("new session, same project:", results["new_session_same_project"])
            results["heads_before_restart"] = serve.heads().get("heads")
        finally:
            serve.stop()
        serve = Serve(args.model, Path(state), args.threads, extra)
        try:
            results["after_restart"] = first_turn(serve.base, "c", body(project, "Rename the config module."))
            print("after restart:", results["after_restart"])
        finally:
            serve.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
