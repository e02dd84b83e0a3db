"""How prefill slows with the context: llama-server's own `prompt_ms` for a block of new tokens after C cached ones,
for C growing to the model's long-prompt range, and the line `seconds/token = a + b·position` fitted to it.

Run:  .venv/bin/python -m benchmarks.estimates.prefill_curve [--model embedded:qwen2.5-coder-0.5b] [--max-tokens 16384]
      [--step 1024] [--out benchmarks/results/prefill_curve.json]

One llama-server (`-t 1`, two slots, no speculation). The prompt is this repository's own source, tokenized by the
server, sent as token ids to `/completion`: on slot 0 each request is the previous one's prompt and `--step` tokens
more, so the slot's cache holds the prefix and llama-server prefills only the step, at positions C..C+step; right
after it slot 1 prefills the first `--step` tokens from nothing: the reference, taken under the same load (the
machine is shared, and its speed drifts more than a step's cost grows). Printed: each step's prefill speed and its
cost per token over the reference's beside it, the line fitted (`routing/prefill_line.py` `PrefillLine`, the proxy's
own fit) to the steps brought to the reference's median speed, and how far the line and one mean per-token cost (the
old model) miss each step.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from tests.support.processes.servers import LlamaServer

from adaptive_spec.llama.binary.which import find_llama_server
from adaptive_spec.llama.models import resolve_model
from adaptive_spec.routing.prefill_line import PrefillLine
from benchmarks.harness import ROOT, results

NAME = "benchmarks.estimates.prefill_curve"  # the result file's `benchmark`


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1800) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
    return answer


def _tokens(server: LlamaServer, count: int) -> list[int]:
    text = "\n".join(p.read_text() for p in sorted((ROOT / "src").rglob("*.py")))
    ids: list[int] = _post(server.url + "/tokenize", {"content": text})["tokens"]
    assert len(ids) >= count, f"only {len(ids)} tokens of source"
    return ids[:count]


def measure(model: Path, max_tokens: int, step: int, home: Path) -> list[dict[str, float]]:
    args = ("-c", str(2 * (max_tokens + 256)), "--parallel", "2", "--spec-type", "none", "-b", "2048", "-ub", "512")
    server = LlamaServer(find_llama_server(None), model, *args, log_dir=home / "logs")
    points = []
    try:
        ids = _tokens(server, max_tokens)
        for end in range(step, max_tokens + 1, step):
            body = {"prompt": ids[:end], "n_predict": 1, "cache_prompt": True, "temperature": 0, "id_slot": 0}
            t = _post(server.url + "/completion", body)["timings"]
            reference = {"prompt": ids[:step], "n_predict": 1, "cache_prompt": False, "temperature": 0, "id_slot": 1}
            r = _post(server.url + "/completion", reference)["timings"]
            point = {
                "cached": t.get("cache_n", 0),
                "new": t["prompt_n"],
                "prompt_ms": t["prompt_ms"],
                "reference_ms_per_token": r["prompt_ms"] / r["prompt_n"],
            }
            points.append(point)
            rate = point["new"] / point["prompt_ms"] * 1000
            ratio = point["prompt_ms"] / point["new"] / point["reference_ms_per_token"]
            print(
                f"  after {point['cached']:>6,} cached: {point['new']:>5} new in {point['prompt_ms']:>9,.0f} ms "
                f"= {rate:7.1f} tok/s; {ratio:5.2f}x the reference's cost per token",
                flush=True,
            )
    finally:
        server.stop()
    return points


def fit(points: list[dict[str, float]]) -> dict[str, Any]:
    """The proxy's own fit over every step, each brought to the reference's median speed, and each step's miss by
    the line and by one mean per-token cost (the old model)."""
    reference = statistics.median(p["reference_ms_per_token"] for p in points)
    steady = [{**p, "prompt_ms": p["prompt_ms"] * reference / p["reference_ms_per_token"]} for p in points]
    line = PrefillLine()
    for p in steady:
        line.add(int(p["cached"]), int(p["new"]), p["prompt_ms"] / 1000.0, 1.0)
    rate = line.solve(0.0, 0.0, 0.0)
    flat = sum(p["prompt_ms"] for p in steady) / sum(p["new"] for p in steady) / 1000.0
    rows = []
    for p in steady:
        true_s = p["prompt_ms"] / 1000.0
        rows.append(
            {
                **p,
                "cost_vs_reference": round(p["prompt_ms"] / p["new"] / reference, 3),
                "line_error": round(rate.seconds(p["new"], p["cached"]) / true_s - 1, 4),
                "flat_error": round(flat * p["new"] / true_s - 1, 4),
            }
        )
    return {
        "a_s_per_token": rate.a_s,
        "b_s_per_token_per_1k": rate.b_s_per_1k,
        "slowdown_per_1k": rate.b_s_per_1k / rate.a_s,
        "flat_s_per_token": flat,
        "reference_ms_per_token_median": reference,
        "steps": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="embedded:qwen2.5-coder-0.5b")
    parser.add_argument("--max-tokens", type=int, default=16384)
    parser.add_argument("--step", type=int, default=1024)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "prefill_curve.json")
    args = parser.parse_args()
    model = Path(resolve_model(args.model))
    print(f"{args.model}: prefill of {args.step} tokens at a time, up to {args.max_tokens:,} (-t 1)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        points = measure(model, args.max_tokens, args.step, Path(tmp))
    result = fit(points)
    errors = [abs(r["line_error"]) for r in result["steps"]]
    flat = [abs(r["flat_error"]) for r in result["steps"]]
    print(
        f"line: {result['a_s_per_token'] * 1000:.2f} ms/token + {result['b_s_per_token_per_1k'] * 1000:.3f} ms "
        f"per 1k of position (slowdown {result['slowdown_per_1k']:.3f} per 1k)"
    )
    print(
        f"error per step: line median {statistics.median(errors):.1%}, worst {max(errors):.1%}; "
        f"one mean cost median {statistics.median(flat):.1%}, worst {max(flat):.1%}"
    )
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    result |= {
        "model": args.model,
        "threads": 1,
        "commit": commit.stdout.strip(),
        "machine": f"{platform.machine()}, {platform.processor() or platform.system()}",
    }
    existing = results.read(args.out) if args.out.exists() else {}
    existing[args.model] = result
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results.write(args.out, NAME, existing)
    print(f"written: {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
