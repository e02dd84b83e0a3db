"""Routing on real agent sessions: each recorded turn replayed on every profile, against what the router chose.

Record an agent's session through `adaptive-spec serve --trace FILE --trace-content` (opencode, Codex CLI, ...: the
commands in examples/README.md). The trace holds each request's body and the router's decision. This replays every
generating turn of the trace, in order, through a running adaptive-spec: pinned to each profile in turn (the order
rotates from turn to turn), then unpinned under a new session of its own (the router's choice, live), all greedy
(`temperature: 0`), so every arm decodes the same tokens and only the speculation differs. It reports per turn:
the router's estimated copyability when the agent sent it (from the recorded reason) against the acceptance
measured when it is replayed with n-gram drafting; the profile the router chose then and now; which profile
decoded it fastest; and over the session, each arm's decode tok/s (generated tokens over llama-server's decode
time).

Replay on freshly started servers, the routed arm on servers of its own (`--routed-url`: a second adaptive-spec).
llama-server's ngram-mod table is one for the whole server, fed by every request's prompt and drafted output, and
kept until it is a quarter full (common/speculative.cpp): a server that served the recorded session already knows
its later turns and drafts them from memory, and a routed arm beside the pinned ones would copy the output the
pinned n-gram arm just drafted.

The recordings hold the agents' own prompts: keep them under your own state folder, not in a repository. What this
writes (`--out`) holds only figures.

    python -m benchmarks.agents.replay --trace ~/.local/state/adaptive-spec/trace.jsonl --url http://127.0.0.1:8088 \
        --routed-url http://127.0.0.1:8089 [--agent opencode] [--max-tokens 256] \
        [--out benchmarks/results/agent_replay.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.harness import results

NAME = "benchmarks.agents.replay"  # the result file's `benchmark`
PROFILE_HEADER = "x-adaptive-spec-profile"
_COPYABLE = re.compile(r"copyable (\d+)%")
_APIS = {"chat": "/v1/chat/completions", "responses": "/v1/responses"}


def recorded_turns(lines: Iterable[Mapping[str, Any]], agent: str | None = None) -> list[dict[str, Any]]:
    """The trace's generating turns with their bodies, in order (side requests such as titles left out), each with
    what the router decided when the agent sent it."""
    turns = []
    for line in lines:
        if line.get("kind") != "request" or line.get("api") not in _APIS or not line.get("request_body"):
            continue
        if line.get("side") or (agent is not None and line.get("client") != agent):
            continue
        turns.append(
            {
                "request_id": line.get("request_id"),
                "session": line.get("session_id"),
                "api": line["api"],
                "body": line["request_body"],
                "profile": line.get("profile"),
                "est_copyable": _copyable(line.get("reason") or ""),
            }
        )
    return turns


def _post(base: str, path: str, body: Mapping[str, Any], headers: Mapping[str, str]) -> dict[str, Any]:
    """The proxy's record of the request (its timings are llama-server's, whichever API carried them)."""
    request = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST")
    for key, value in {"Content-Type": "application/json", **headers}.items():
        request.add_header(key, value)
    with urllib.request.urlopen(request, timeout=3600) as resp:
        resp.read()
        request_id = resp.headers.get("x-adaptive-spec-request-id")
    with urllib.request.urlopen(base + "/adaptive/requests?limit=20", timeout=60) as resp:
        records = json.loads(resp.read())["requests"]
    return dict(next(r for r in records if r["request_id"] == request_id))


def _copyable(reason: str) -> float | None:
    found = _COPYABLE.search(reason)
    return int(found.group(1)) / 100 if found else None


def _arm(record: Mapping[str, Any]) -> dict[str, Any]:
    timings = record.get("timings") or {}
    return {
        "profile": record.get("profile"),
        "route": record.get("route"),
        "est_copyable": _copyable(record.get("reason") or ""),
        "predicted_n": timings.get("predicted_n", 0),
        "predicted_ms": timings.get("predicted_ms", 0.0),
        "prompt_n": timings.get("prompt_n", 0),
        "draft_n": timings.get("draft_n", 0),
        "draft_n_accepted": timings.get("draft_n_accepted", 0),
    }


def replay(
    base: str, routed_base: str, turns: Sequence[dict[str, Any]], profiles: Sequence[str], max_tokens: int
) -> list[dict[str, Any]]:
    run = f"{int(time.time())}"  # sessions of this run's own: a second run learns nothing from the first
    out = []
    for i, turn in enumerate(turns):
        # Streamed where llama-server's timings come only at a stream's end (the Responses API's whole body carries
        # usage, not decode time).
        body = {**turn["body"], "temperature": 0, "seed": 1, "stream": turn["api"] == "responses"}
        body.pop("stream_options", None)
        key = "max_output_tokens" if turn["api"] == "responses" else "max_tokens"
        body[key] = min(int(body.get(key) or max_tokens), max_tokens)
        path = _APIS[turn["api"]]
        order = list(profiles[i % len(profiles) :]) + list(profiles[: i % len(profiles)])
        arms = {}
        for name in order:
            pinned = {PROFILE_HEADER: name, "x-session-id": f"replay-{run}-{turn['session']}"}
            arms[name] = _arm(_post(base, path, body, pinned))
        routed = {"x-session-id": f"routed-{run}-{turn['session']}"}
        arms["routed"] = _arm(_post(routed_base, path, body, routed))
        out.append({**{k: v for k, v in turn.items() if k != "body"}, "arms": arms})
        print(f"turn {i}: " + ", ".join(f"{k} {_tps(v):.1f} tok/s" for k, v in arms.items()), flush=True)
    return out


def _tps(arm: Mapping[str, Any]) -> float:
    return arm["predicted_n"] / (arm["predicted_ms"] / 1000) if arm["predicted_ms"] else 0.0


def summarize(replayed: Sequence[Mapping[str, Any]], ngram_profile: str) -> dict[str, Any]:
    """Per arm: tok/s over the session; per turn: est copyability vs measured acceptance (on the n-gram profile),
    and whether the router's profile then was the faster one."""
    names = list(replayed[0]["arms"]) if replayed else []
    totals = {
        name: sum(t["arms"][name]["predicted_n"] for t in replayed)
        / max(sum(t["arms"][name]["predicted_ms"] for t in replayed) / 1000, 1e-9)
        for name in names
    }
    pairs: dict[str, list[tuple[float, float]]] = {"recorded": [], "replayed": []}
    chose = {"recorded": [0, 0], "replayed": [0, 0]}
    for t in replayed:
        arm = t["arms"].get(ngram_profile)
        measured = arm["draft_n_accepted"] / arm["predicted_n"] if arm and arm["predicted_n"] else None
        pinned = {k: v for k, v in t["arms"].items() if k != "routed" and v["predicted_ms"]}
        fastest = max(pinned, key=lambda k: _tps(pinned[k])) if pinned else None
        # when the agent sent it (the recorded reason), and now (the routed arm, this code, this run's session)
        for when, est, profile in (
            ("recorded", t["est_copyable"], t["profile"]),
            ("replayed", t["arms"]["routed"]["est_copyable"], t["arms"]["routed"]["profile"]),
        ):
            if est is not None and measured is not None:
                pairs[when].append((est, measured))
            if fastest is not None and profile in pinned and len(pinned) > 1:
                chose[when][1] += 1
                chose[when][0] += profile == fastest or _tps(pinned[profile]) >= 0.95 * _tps(pinned[fastest])
    return {
        "turns": len(replayed),
        "tok_s": totals,
        "router_chose_fastest": {k: f"{a}/{b} (within 5% of the fastest)" for k, (a, b) in chose.items()},
        "est_vs_measured": {
            when: {
                "pairs": len(found),
                "correlation": _pearson(found),
                "median_abs_error": statistics.median(abs(e - m) for e, m in found) if found else None,
            }
            for when, found in pairs.items()
        },
    }


def _pearson(pairs: Sequence[tuple[float, float]]) -> float | None:
    if len(pairs) < 3:
        return None
    xs, ys = [p[0] for p in pairs], [p[1] for p in pairs]
    if statistics.pstdev(xs) == 0 or statistics.pstdev(ys) == 0:
        return None
    return statistics.correlation(xs, ys)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, required=True, help="a trace written with --trace-content")
    parser.add_argument("--url", default="http://127.0.0.1:8088", help="the running adaptive-spec (pinned arms)")
    parser.add_argument("--routed-url", help="the adaptive-spec for the routed arm, on servers of its own")
    parser.add_argument("--agent", help="only this client's turns (opencode, codex, ...)")
    parser.add_argument("--profiles", default="oneshot,iterative")
    parser.add_argument("--ngram-profile", default="iterative", help="the profile that drafts with n-grams")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/agent_replay.json"))
    args = parser.parse_args()
    lines = [json.loads(line) for line in args.trace.read_text().splitlines() if line.strip()]
    turns = recorded_turns(lines, args.agent)
    if not turns:
        parser.error(f"{args.trace}: no generating turns with their bodies (record it with --trace-content)")
    started = time.time()
    if args.routed_url is None:
        print("warning: the routed arm shares the pinned arms' servers and their n-gram table", file=sys.stderr)
    base = args.url.rstrip("/")
    routed = (args.routed_url or base).rstrip("/")
    replayed = replay(base, routed, turns, args.profiles.split(","), args.max_tokens)
    result = {"agent": args.agent, "seconds": round(time.time() - started), **summarize(replayed, args.ngram_profile)}
    result["per_turn"] = replayed
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results.write(args.out, NAME, result)
    print(json.dumps({k: v for k, v in result.items() if k != "per_turn"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
