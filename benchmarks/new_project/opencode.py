"""A new project of opencode: its working directory sits inside its system prompt, so a second project's first turn
parts from the first project's head inside that piece. Measured through `serve` on one slot: the first project's
first turn cold, its head kept; another agent's head kept after it (the most recently used: the one a restart puts
back into the idle slot); `serve` restarted (llama-server's RAM cache of prompts gone); then the second project's first
turn. Its prompt_n, cache_n, time to first token, the router's new-token estimate and the route's reason come from
the proxy's own request records; the tokens the two prompts share from llama-server's /tokenize.

Run:  .venv/bin/python -m benchmarks.new_project.opencode [--model embedded:qwen2.5-coder-0.5b] [--threads 1]
      [--out FILE.json] [--no-heads] (the same sequence without the store)

No vendor's prompt is used: a generated system prompt and 12 tools of opencode's measured size (~7.2k tokens on the
0.5B), ~1.8k tokens of it before the working directory, as in opencode's own.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.support.processes.servers import ProxyProcess, http_json

from adaptive_spec.bench import machine
from benchmarks.harness import RESULTS, results

NAME = "benchmarks.new_project.opencode"
_WORDS = ("path", "pattern", "offset", "limit", "content", "command", "file", "edit", "tests", "small", "typed")


def _lines(rng: random.Random, count: int, what: str) -> str:
    return "\n".join(
        f"{what} {i}: " + " ".join(rng.choice(_WORDS) for _ in range(14)) + f" (see section {i})." for i in range(count)
    )


def body(project: str) -> dict[str, Any]:
    """opencode's first turn in `project`: its rules, its environment (the working directory), more rules, 12 tools."""
    rng = random.Random("opencode")
    before, after = _lines(rng, 72, "Rule"), _lines(rng, 120, "Guideline")
    env = f"<env>\nWorking directory: {project}\nIs directory a git repo: yes\nPlatform: linux\n</env>"
    system = f"You are opencode, an interactive CLI coding agent.\n{before}\n{env}\n{after}"
    tools = []
    for i in range(12):
        words = " ".join(rng.choice(_WORDS) for _ in range(40))
        props = {
            f"arg_{j}": {"type": "string", "description": f"Argument {j}: {words[: 80 + 20 * j]}"} for j in range(5)
        }
        params = {"type": "object", "properties": props, "required": ["arg_0"]}
        tools.append(
            {"type": "function", "function": {"name": f"tool_{i}", "description": words, "parameters": params}}
        )
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Add a /health endpoint."}]
    return {"model": "m", "stream": True, "max_tokens": 8, "temperature": 0, "messages": messages, "tools": tools}


def other_agent() -> dict[str, Any]:
    """Another agent's first turn (~700 tokens): a head of its own, sharing nothing with opencode's."""
    system = "You are another assistant.\n" + _lines(random.Random("other"), 40, "Habit")
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Explain the config loader."}]
    return {"model": "m", "stream": True, "max_tokens": 8, "temperature": 0, "messages": messages}


class Serve(ProxyProcess):
    def __init__(self, model: str, state: Path, threads: int, extra: list[str]) -> None:
        args = ("--model", model, "--threads", str(threads), "--parallel", "1", "--ctx-size", "16384", *extra)
        super().__init__(*args, env={"ADAPTIVE_SPEC_STATE_DIR": str(state)}, ready_timeout=1800.0)

    def send(self, data: dict[str, Any], session: str) -> dict[str, Any]:
        headers = {"Content-Type": "application/json", "x-session-id": session, "User-Agent": "opencode/1.0.0"}
        req = urllib.request.Request(self.base + "/v1/chat/completions", json.dumps(data).encode(), headers)
        with urllib.request.urlopen(req, timeout=3600) as resp:
            request_id = resp.headers["x-adaptive-spec-request-id"]
            for _ in resp:
                pass
        for _ in range(200):
            found = [r for r in self.requests() if r["request_id"] == request_id]
            if found:
                t = found[0].get("timings") or {}
                return {
                    "ttft_s": round((found[0].get("ttft_ms") or 0) / 1000.0, 2),
                    "prompt_n": t.get("prompt_n"),
                    "cache_n": t.get("cache_n"),
                    "new_tokens_est": found[0].get("new_tokens_est"),
                    "reason": found[0].get("reason"),
                }
            time.sleep(0.05)
        raise SystemExit(f"no record of {request_id}")

    def heads(self, count: int) -> None:
        """Wait until the store keeps `count` heads (a store that is off keeps none: no wait)."""
        deadline = time.monotonic() + 300
        while http_json(self.base + "/adaptive/heads").get("enabled") and time.monotonic() < deadline:
            if len(http_json(self.base + "/adaptive/heads")["heads"]) >= count:
                return
            time.sleep(0.2)

    def shared_tokens(self, a: dict[str, Any], b: dict[str, Any]) -> tuple[int, int]:
        """(the tokens the two prompts share at their start, b's tokens), as llama-server tokenizes them."""
        (server,) = {p["base_url"] for p in http_json(self.base + "/adaptive/profiles")["profiles"]}
        ids = []
        for data in (a, b):
            prompt = http_json(f"{server}/apply-template", {"messages": data["messages"], "tools": data["tools"]})
            ids.append(http_json(f"{server}/tokenize", {"content": prompt["prompt"], "parse_special": True})["tokens"])
        n = 0
        while n < min(map(len, ids)) and ids[0][n] == ids[1][n]:
            n += 1
        return n, len(ids[1])


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--model", default="embedded:qwen2.5-coder-0.5b")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-heads", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS / "new_project_opencode.json")
    args = parser.parse_args()
    started = machine.sample()
    extra = ["--no-heads"] if args.no_heads else []
    alpha, beta = body("/home/dev/projects/shop"), body("/home/dev/projects/blog")
    figures: dict[str, Any] = {"model": args.model, "threads": args.threads, "heads": not args.no_heads}
    with tempfile.TemporaryDirectory(prefix="new-project-") as state:
        serve = Serve(args.model, Path(state), args.threads, extra)
        try:
            figures["first_project_cold"] = serve.send(alpha, "shop")
            serve.heads(1)
            figures["other_agent"] = serve.send(other_agent(), "other")
            serve.heads(2)
            figures["shared_tokens"], figures["second_project_tokens"] = serve.shared_tokens(alpha, beta)
        finally:
            serve.stop()
        serve = Serve(args.model, Path(state), args.threads, extra)
        try:
            time.sleep(5.0)  # the start's restore of the most recent head runs in the background
            figures["second_project_after_restart"] = serve.send(beta, "blog")
        finally:
            serve.stop()
    for case in ("first_project_cold", "second_project_after_restart"):
        print(f"{case}: {figures[case]}")
    print(f"shared tokens: {figures['shared_tokens']} of {figures['second_project_tokens']}")
    print(f"written to {results.write(args.out, NAME, figures, started=started)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
