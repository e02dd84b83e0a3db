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
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.agent_sessions import Post, Sent, claude_code, gemini_cli, poster, qwen_code
from tests.support.processes.servers import ProxyProcess

ERROR = 0.15

FIRST_TURN = {"Gemini CLI": 1}  # the conversation's first turn comes after its classifier
AGENTS: dict[str, Callable[[Post], list[Sent]]] = {
    "Claude Code": lambda post: claude_code(post, "cc-follow-ups", compaction=True),
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
            records = [sent.record for sent in AGENTS[name](poster(proxy))]
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
