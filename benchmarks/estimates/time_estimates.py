"""A route's time estimates against llama-server's own timings, for agent-shaped first turns of growing size, on a
fresh `adaptive-spec serve` and on the same `serve` restarted (its speed model kept in the state folder).

Run:  .venv/bin/python -m benchmarks.estimates.time_estimates [--sizes 2048,4096,8192]
      [--out benchmarks/results/time_estimates.json]

Each first turn is a new session in the shape a coding agent opens one (a system prompt of rules, four tool schemas, a
user message carrying the repository's own source files), seeded so every run sends the same bytes, sized to about
the tokens asked. `serve` runs the embedded Qwen2.5-Coder-0.5B, `-t 1`, one slot. The figures are the records'
`time_estimate` (estimated over measured, less 1), beside what the old model would have said of the same request:
the router's own new-token estimate × one prior cost per token (`prefill_tps` 400), the estimate issue 53 found
off by more than six times. Printed: per request, and the median and worst size of each error per run.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from tests.support.processes.servers import ProxyProcess

from benchmarks.harness import ROOT, results

NAME = "benchmarks.estimates.time_estimates"  # the result file's `benchmark`
OLD_PRIOR_TPS = 400.0  # the prior the old model priced every prompt token at until it had measured requests
CHARS_PER_TOKEN = 3.2  # Qwen's vocabulary on this repository's source: only to size the turns


def _sources() -> list[str]:
    return [p.read_text() for p in sorted((ROOT / "src").rglob("*.py")) if p.stat().st_size > 2000]


def first_turn(tokens: int, seed: int, sources: list[str]) -> dict[str, Any]:
    rng = random.Random(seed)
    rules = "\n".join(f"{i}. Rule {rng.randrange(10**6)}: keep the change small and tested." for i in range(30))
    tools = [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": f"{name} a file of the project (seed {seed}).",
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
            },
        }
        for name in ("read", "write", "edit", "grep")
    ]
    files, chars = [], 0
    for text in rng.sample(sources, len(sources)):
        if chars >= tokens * CHARS_PER_TOKEN:
            break
        part = text[: int(tokens * CHARS_PER_TOKEN) - chars]
        files.append(f"```python\n{part}\n```")
        chars += len(part)
    messages = [
        {"role": "system", "content": f"You are a coding agent (session {seed}).\n{rules}"},
        {"role": "user", "content": "Here are the files:\n" + "\n".join(files) + "\nAdd a docstring to the first."},
    ]
    return {"model": "m", "messages": messages, "tools": tools, "max_tokens": 32, "temperature": 0}


def _send(proxy: ProxyProcess, body: dict[str, Any], session: str) -> dict[str, Any]:
    req = urllib.request.Request(
        proxy.base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "x-session-id": session},
    )
    with urllib.request.urlopen(req, timeout=3600) as resp:
        resp.read()
        request_id = resp.headers["x-adaptive-spec-request-id"]
    return next(r for r in proxy.requests() if r["request_id"] == request_id)


def run(name: str, state: Path, sizes: list[int], seed: int) -> list[dict[str, Any]]:
    proxy = ProxyProcess(
        "--threads", "1", "--ctx-size", str(max(sizes) * 2 + 4096), env={"ADAPTIVE_SPEC_STATE_DIR": str(state)}
    )
    rows = []
    sources = _sources()
    try:
        for i, size in enumerate(sizes):
            record = _send(proxy, first_turn(size, seed + i, sources), f"{name}-{i}")
            t, est = record["timings"], record["time_estimate"] or {}
            prefill_s = t["prompt_ms"] / 1000.0
            old = (record["new_tokens_est"] or 0) / OLD_PRIOR_TPS
            row = {
                "run": name,
                "prompt_n": t["prompt_n"],
                "cache_n": t["cache_n"],
                "new_tokens_est": record["new_tokens_est"],
                "basis": est.get("basis"),
                "prefill_s": prefill_s,
                "prefill_s_est": est.get("prefill_s_est"),
                "prefill_error": est.get("prefill_error"),
                "old_prefill_s_est": round(old, 3),
                "old_prefill_error": round(old / prefill_s - 1, 4) if prefill_s > 0 else None,
                "decode_s": est.get("decode_s"),
                "decode_error": est.get("decode_error"),
                "reason": record["reason"],
            }
            rows.append(row)
            print(
                f"  {name:9} {t['prompt_n']:>6,} tok ({row['basis']}): prefill {prefill_s:7.1f} s, estimated "
                f"{row['prefill_s_est']:7.1f} s ({row['prefill_error']:+.0%}), old model {old:6.1f} s "
                f"({row['old_prefill_error']:+.0%}); decode {row['decode_error']:+.0%}",
                flush=True,
            )
        own = [r for r in proxy.requests() if r.get("own")]
        print(f"  {name}: {len(own)} speed measurement(s) at start", flush=True)
    finally:
        proxy.stop()
    return rows


def summary(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    values = [abs(r[key]) for r in rows if r.get(key) is not None]
    return {"median": round(statistics.median(values), 4), "worst": round(max(values), 4)} if values else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="2048,4096,8192")
    parser.add_argument("--seed", type=int, default=53)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "time_estimates.json")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    result: dict[str, Any] = {"sizes": sizes, "threads": 1, "model": "embedded:qwen2.5-coder-0.5b"}
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state"
        rows = run("fresh", state, sizes, args.seed) + run("restarted", state, sizes, args.seed + 100)
    for name in ("fresh", "restarted"):
        mine = [r for r in rows if r["run"] == name]
        result[name] = {k: summary(mine, k) for k in ("prefill_error", "old_prefill_error", "decode_error")}
        f = result[name]
        print(
            f"{name}: prefill error median {f['prefill_error']['median']:.0%}, worst {f['prefill_error']['worst']:.0%}"
            f" (old model: median {f['old_prefill_error']['median']:.0%}, worst {f['old_prefill_error']['worst']:.0%});"
            f" decode median {f['decode_error']['median']:.0%}, worst {f['decode_error']['worst']:.0%}"
        )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    result |= {"commit": commit.stdout.strip(), "requests": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results.write(args.out, NAME, result)
    print(f"written: {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
