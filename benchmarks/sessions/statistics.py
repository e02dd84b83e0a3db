"""Cost of the per-session statistics: time per turn at 10k / 50k / 100k-token histories, and memory per session.

Run:  .venv/bin/python -m benchmarks.sessions.statistics [--out benchmarks/results/sessions.json]

A synthetic coding session: each turn adds a 200-token user message and a 600-token reply that copies most of a
file from the context (the iterative case, where the drafter simulation does the most work). Timed: planning which
messages are new, indexing them, and replaying the reply through the counterfactual drafter (tokenizing is
separate: it is cached by content and measured on its own below).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

from adaptive_spec.sessions.ngram_replay import NgramParams
from adaptive_spec.sessions.statistics import ContextTracker
from adaptive_spec.sessions.tokenizers import CachingTokenizer, tiktoken_o200k
from benchmarks.harness import results
from benchmarks.harness.stats import percentile

NAME = "benchmarks.sessions.statistics"  # the result file's `benchmark`
VOCAB = 150_000


def _digest(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=12).digest()


def _turn(rng: random.Random, file_tokens: list[int]) -> tuple[list[int], list[int]]:
    user = [rng.randrange(VOCAB) for _ in range(200)]
    start = rng.randrange(0, max(1, len(file_tokens) - 600))
    reply = file_tokens[start : start + 540] + [rng.randrange(VOCAB) for _ in range(60)]
    return user, reply


def _grow(tracker: ContextTracker, target: int, rng: random.Random) -> tuple[list[bytes], list[int]]:
    """Build a session history of about `target` tokens; returns its message digests and a file to copy from."""
    file_tokens = [rng.randrange(VOCAB) for _ in range(2000)]
    digests = [_digest(0)]
    tracker.on_prompt("s", "p", digests, [file_tokens], 0.0)
    n = 1
    session = tracker._sessions.get("s")
    assert session is not None
    while len(session.index) < target:
        user, reply = _turn(rng, file_tokens)
        tracker.on_output("s", "p", _digest(n), reply, 0.0)
        digests += [_digest(n), _digest(n + 1)]
        tracker.on_prompt("s", "p", digests, [user], 0.0)
        n += 2
    return digests, file_tokens


def measure(history: int, turns: int) -> dict[str, Any]:
    rng = random.Random(history)
    tracker = ContextTracker(NgramParams(), max_tokens=max(131_072, history * 2))
    tracemalloc.start()
    digests, file_tokens = _grow(tracker, history, rng)
    memory, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    start = tracker.snapshot("s")
    assert start is not None
    times = []
    n = len(digests) + 10
    for _ in range(turns):
        user, reply = _turn(rng, file_tokens)
        new_digests = [*digests, _digest(n), _digest(n + 1)]
        started = time.perf_counter()
        pick = tracker.pick("s", [(d, False) for d in new_digests])
        tracker.on_prompt("s", "p", new_digests, [user] * len(pick[-1:]), 0.0)
        tracker.on_output("s", "p", _digest(n + 2), reply, 0.0)
        times.append((time.perf_counter() - started) * 1000)
        digests = [*new_digests, _digest(n + 2)]
        n += 3
    snap = tracker.snapshot("s")
    assert snap is not None
    return {
        "history_tokens": start.indexed_tokens,
        "history_tokens_after": snap.indexed_tokens,
        "index_estimate_mib": start.memory_bytes / 2**20,
        "turn_ms_median": statistics.median(times),
        "turn_ms_p90": percentile(times, 0.9),
        "session_memory_mib": memory / 2**20,
        "est_accepted_share_ewma": snap.est_accepted_share_ewma,
    }


def tokenizer_cost() -> dict[str, float]:
    tok = CachingTokenizer(tiktoken_o200k())
    text = "def handle(request):\n    return render(request, 'index.html', {'items': items})\n" * 40
    started = time.perf_counter()
    first = asyncio.run(tok.encode([text]))
    cold_ms = (time.perf_counter() - started) * 1000
    started = time.perf_counter()
    asyncio.run(tok.encode([text]))
    warm_ms = (time.perf_counter() - started) * 1000
    return {"tokens": len(first[0]), "cold_ms": cold_ms, "cached_ms": warm_ms}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--out", default="benchmarks/results/sessions.json")
    args = parser.parse_args()
    rows = [measure(h, args.turns) for h in (10_000, 50_000, 100_000)]
    print("\nsession statistics cost per turn (200 new prompt tokens + a 600-token reply replayed), one session")
    print("| history (tokens) | per turn, median (ms) | per turn, p90 (ms) | memory per session (MiB) |")
    print("|---|---|---|---|")
    for r in rows:
        cells = [f"{r['history_tokens']:,}", f"{r['turn_ms_median']:.2f}", f"{r['turn_ms_p90']:.2f}"]
        print("| " + " | ".join([*cells, f"{r['session_memory_mib']:.1f}"]) + " |")
    tok = tokenizer_cost()
    print(f"\ntiktoken o200k, {tok['tokens']} tokens: {tok['cold_ms']:.2f} ms cold, {tok['cached_ms']:.3f} ms cached")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results.write(out, NAME, {"rows": rows, "tokenizer": tok})
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
