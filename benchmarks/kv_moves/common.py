"""What the KV-moving benchmarks (`relay_mover.py`, `remote_prefill.py`) share: the models, their prompts, the
servers' arguments, and the command line that runs a bench and writes its table and JSON."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.models.tiny_gguf import write_tiny_gguf

from adaptive_spec.llama.models import ensure_embedded
from benchmarks.harness import results

KEY = "bench-relay-key"

Rows = list[dict[str, Any]]


def model(name: str, home: Path) -> tuple[Path, float]:
    """The GGUF for `tiny` or `qwen`, and its characters per token (the tiny model's vocabulary is mostly bytes)."""
    if name == "tiny":
        return write_tiny_gguf(home / "tiny.gguf"), 1.0
    return ensure_embedded("qwen2.5-coder-0.5b"), 3.0


def server_args(tokens: list[int]) -> tuple[str, ...]:
    return ("-c", str(min(32768, max(tokens) * 2 + 512)), "--parallel", "1", "--spec-type", "none")


def prompt(run: int, chars: int) -> list[dict[str, str]]:
    lines = [f"run {run}: a log to summarise"]
    i = 0
    while sum(len(x) + 1 for x in lines) < chars:
        lines.append(f"line {i}: worker={i % 7} value={i * 7919 % 10007} status={'ok' if i % 5 else 'retry'}")
        i += 1
    return [{"role": "user", "content": "\n".join(lines) + "\nSummarise it in one line."}]


def run_main(
    name: str,
    doc: str | None,
    out: str,
    bench: Callable[[list[str], list[int], Path], Rows],
    table: Callable[[Rows], str],
) -> None:
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,qwen")
    parser.add_argument("--tokens", default="1000,3500")  # the tiny model's context is 4,096
    parser.add_argument("--out", type=Path, default=Path(out))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = bench(args.models.split(","), [int(t) for t in args.tokens.split(",")], Path(tmp))
    print(table(rows))
    results.write(args.out, name, {"rows": rows})
    print(f"written: {args.out}")
