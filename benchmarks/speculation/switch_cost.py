"""What a session's profile switch costs: one server with speculation per request, against one server per profile
with the KV cache handed over, and with it re-prefilled.

Run:  .venv/bin/python -m benchmarks.speculation.switch_cost [--out benchmarks/results/switch_cost.json]
      [--models qwen,hybrid] [--rounds 3] [--turns 2]

Three `serve` launches per model, all up at once, each session's turns sequential, `-t 1` per llama-server:

- one server: `serve` (oneshot = n-gram off, iterative = ngram-mod, both per-request settings of one llama-server);
- handoff: `serve --server-per-profile` with `[handoff] min_tokens = 0`: the slot is saved on the oneshot server and
  restored on the iterative one;
- re-prefill: the same with `[handoff] enabled = false`: the iterative server prefills the whole conversation.

A session pastes a few thousand tokens (the shipped workloads' files), runs `--turns` turns pinned to oneshot and one
more pinned to iterative (`x-adaptive-spec-profile`); the moved turn's time to first token (at the client, and as the
proxy measured it) and `cache_n` are read from its record in `GET /adaptive/requests`. The arms run in turn, their
order rotated each round, and each session opens with its own line so no round reuses another's prefix.

Models: the embedded Qwen2.5-Coder-0.5B, and the tiny random-weight hybrid target (`qwen35`: a gated-delta-net layer
beside attention, `--draft-type mtp`), on which llama-server re-prefills all after a slot restore.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from tests.support.models.tiny_drafters import write_tiny_mtp_target
from tests.support.processes.servers import ProxyProcess

from adaptive_spec.bench.stream import stream_chat
from adaptive_spec.common.headers import PROFILE_HEADER, SESSION_ID_HEADER
from benchmarks.harness import ROOT, results

NAME = "benchmarks.speculation.switch_cost"  # the result file's `benchmark`
WORKLOADS = ROOT / "src" / "adaptive_spec" / "bench" / "workloads"
ARMS = ("one server", "handoff", "re-prefill")
# Routing turns over at once: hand over any context (or none at all), move after one turn.
POLICIES = {
    "handoff": "[route]\nmin_dwell_turns = 1\n\n[handoff]\nmin_tokens = 0\n",
    "re-prefill": "[route]\nmin_dwell_turns = 1\n\n[handoff]\nenabled = false\n",
}
MAX_TOKENS = 16
Record = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Model:
    name: str
    serve_args: tuple[str, ...]
    context_tokens: int  # the pasted conversation before the switch, roughly
    chars_per_token: float  # of the pasted code (measured); the tiny model's vocabulary is mostly bytes


def models(names: list[str], home: Path) -> list[Model]:
    known = {
        "qwen": Model("Qwen2.5-Coder-0.5B (embedded)", (), 3000, 3.7),
        "hybrid": Model(
            "tiny qwen35 hybrid + MTP",
            ("--model", str(write_tiny_mtp_target(home / "tiny-random-qwen35-mtp.gguf")), "--draft-type", "mtp"),
            2500,
            1.0,
        ),
    }
    return [known[n] for n in names]


def pasted_files() -> list[str]:
    """The files the shipped workloads paste (their first turns' code blocks), each once."""
    blocks: list[str] = []
    for name in ("iterative", "mixed"):
        for request in json.loads((WORKLOADS / f"{name}.json").read_text())["requests"]:
            text = str(request["user"])
            if "```" in text:
                block = text[text.index("```") : text.rindex("```") + 3]
                if block not in blocks:
                    blocks.append(block)
    return blocks


def first_turn(session: str, chars: int) -> str:
    """The session's own line, then the workloads' files as revisions of a project until `chars` long."""
    files, parts, i = pasted_files(), [f"Session {session}: the files of a project under review."], 0
    while sum(len(p) + 2 for p in parts) < chars:
        parts.append(f"Revision {i // len(files)} of module {i % len(files)}:\n{files[i % len(files)]}")
        i += 1
    return "\n\n".join(parts) + "\n\nWhat does this project do?"


FOLLOW_UPS = ("Which function is the most complex?", "What would you test first?", "Name one edge case.")


def launch(model: Model, arm: str, home: Path) -> ProxyProcess:
    folder = home / arm.replace(" ", "-")
    folder.mkdir(parents=True)
    args = [*model.serve_args, "--threads", "1", "--ctx-size", "8192"]
    if arm != "one server":
        (folder / "policy.toml").write_text(POLICIES[arm])
        args += ["--server-per-profile", "--policy", str(folder / "policy.toml")]
    env = {"ADAPTIVE_SPEC_STATE_DIR": str(folder / "state"), "ADAPTIVE_SPEC_CONFIG_DIR": str(folder / "config")}
    return ProxyProcess(*args, env=env)


async def turn(
    http: aiohttp.ClientSession, proxy: ProxyProcess, session: str, messages: list[dict[str, str]], profile: str
) -> Record:
    """One greedy streamed turn pinned to `profile`: its record, with the client's time to first token and the text."""
    body = {"model": "m", "messages": messages, "temperature": 0, "seed": 1, "max_tokens": MAX_TOKENS, "stream": True}
    headers = {SESSION_ID_HEADER: session, PROFILE_HEADER: profile}
    reply = await stream_chat(http, proxy.base + "/v1/chat/completions", body, headers)
    async with http.get(proxy.base + "/adaptive/requests") as resp:
        records = (await resp.json())["requests"]
    record: Record = [r for r in records if r["session_id"] == session][-1]  # this session's turns are sequential
    return {**record, "client_ttft_ms": reply.ttft_ms, "text": reply.text}


async def session_run(
    http: aiohttp.ClientSession, proxy: ProxyProcess, session: str, model: Model, turns: int
) -> Record:
    """`turns` turns on oneshot, one on iterative: the moved turn's figures, and the context it moved."""
    history = [{"role": "user", "content": first_turn(session, int(model.context_tokens * model.chars_per_token))}]
    before: Record = {}
    for i in range(turns + 1):
        record = await turn(http, proxy, session, history, "oneshot" if i < turns else "iterative")
        if i < turns:
            before = record
            history += [{"role": "assistant", "content": record["text"]}, {"role": "user", "content": FOLLOW_UPS[i]}]
    if record["moved_from"] != "oneshot" or record["profile"] != "iterative":
        raise RuntimeError(f"session {session}'s last turn did not move from oneshot: {record['reason']}")
    t = record["timings"] or {}
    previous = before["timings"] or {}
    return {
        "session": session,
        "profile": record["profile"],
        "moved_from": record["moved_from"],
        "reason": record["reason"],
        "context_before": previous.get("prompt_n", 0) + previous.get("cache_n", 0) + previous.get("predicted_n", 0),
        "prompt_tokens": t.get("prompt_n", 0) + t.get("cache_n", 0),
        "cache_n": t.get("cache_n"),
        "prompt_n": t.get("prompt_n"),
        "prompt_ms": t.get("prompt_ms"),
        "client_ttft_ms": record["client_ttft_ms"],
        "proxy_ttft_ms": record["ttft_ms"],
        "handoff": record["handoff"],
    }


async def rounds(proxies: dict[str, ProxyProcess], model: Model, n_rounds: int, turns: int) -> list[Record]:
    runs: list[Record] = []
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        for arm, proxy in proxies.items():  # warm both profiles' servers once: first requests page the model in
            for profile in ("oneshot", "iterative"):
                await turn(http, proxy, f"warm-{arm}-{profile}", [{"role": "user", "content": "Hi."}], profile)
        for r in range(n_rounds):
            for arm in ARMS[r % len(ARMS) :] + ARMS[: r % len(ARMS)]:
                run = await session_run(http, proxies[arm], f"round-{r}-arm-{ARMS.index(arm)}", model, turns)
                runs.append({"arm": arm, "round": r, **run})
                ttft = _num(run["client_ttft_ms"])
                print(
                    f"  round {r} {arm:<10}  ttft {ttft:>8} ms  cache_n {run['cache_n']}/{run['prompt_tokens']}",
                    flush=True,
                )
    return runs


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summary(model: Model, runs: list[Record]) -> list[Record]:
    rows: list[Record] = []
    for arm in ARMS:
        mine = [r for r in runs if r["arm"] == arm]
        handoffs = [r["handoff"] for r in mine if r["handoff"]]
        rows.append(
            {
                "model": model.name,
                "arm": arm,
                "rounds": len(mine),
                "context_before": _median([r["context_before"] for r in mine]),
                "prompt_tokens": _median([r["prompt_tokens"] for r in mine]),
                "cache_n": _median([r["cache_n"] for r in mine]),
                "prompt_n": _median([r["prompt_n"] for r in mine]),
                "prompt_ms": _median([r["prompt_ms"] for r in mine]),
                "client_ttft_ms": _median([r["client_ttft_ms"] for r in mine]),
                "proxy_ttft_ms": _median([r["proxy_ttft_ms"] for r in mine]),
                "handoffs_ok": sum(1 for h in handoffs if h.get("ok")),
                "handoff_ms": _median([1000 * (h.get("save_s", 0) + h.get("restore_s", 0)) for h in handoffs]),
            }
        )
    base = rows[0]["client_ttft_ms"]
    for row in rows:
        row["ttft_vs_one_server"] = row["client_ttft_ms"] / base if base and row["client_ttft_ms"] else None
    return rows


def _num(v: float | None, fmt: str = ".0f") -> str:
    return "-" if v is None else format(v, fmt)


def table(rows: list[Record]) -> str:
    lines = [
        f"{'model':<30} {'arm':<10} {'TTFT ms':>8} {'x one':>6} {'proxy':>7} {'cache_n':>8} {'of':>6}"
        f" {'prefilled':>9} {'handoff ms':>10} {'ok':>3}"
    ]
    for r in rows:
        lines.append(
            f"{r['model']:<30} {r['arm']:<10} {_num(r['client_ttft_ms']):>8} {_num(r['ttft_vs_one_server'], '.2f'):>6}"
            f" {_num(r['proxy_ttft_ms']):>7} {_num(r['cache_n']):>8} {_num(r['prompt_tokens']):>6}"
            f" {_num(r['prompt_n']):>9} {_num(r['handoff_ms'], '.1f'):>10} {r['handoffs_ok']:>3}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/switch_cost.json"))
    parser.add_argument("--models", default="qwen,hybrid")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--turns", type=int, default=2, choices=range(1, len(FOLLOW_UPS) + 1), help="on oneshot")
    args = parser.parse_args()
    machine = f"times: wall clock on a shared machine of {os.cpu_count()} cores, -t 1 per llama-server, medians"
    print(machine)
    all_rows: list[Record] = []
    all_runs: list[Record] = []
    designs: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in models(args.models.split(","), Path(tmp)):
            print(f"{model.name}: ~{model.context_tokens} tokens pasted, {args.turns} turns on oneshot, then iterative")
            proxies: dict[str, ProxyProcess] = {}
            try:
                for arm in ARMS:
                    proxies[arm] = launch(model, arm, Path(tmp) / model.name.split()[0])
                    designs[f"{model.name} / {arm}"] = next(
                        line.strip() for line in proxies[arm].stderr_lines if line.strip().startswith("profiles:")
                    )
                runs = asyncio.run(rounds(proxies, model, args.rounds, args.turns))
            finally:
                for proxy in proxies.values():
                    proxy.stop()
            all_runs += [{"model": model.name, **r} for r in runs]
            all_rows += summary(model, runs)
    print()
    print(table(all_rows))
    print(f"({machine}; TTFT at the client, 'proxy' as the proxy measured it; 'x one' = TTFT / one server's)")
    result = {"note": machine, "max_tokens": MAX_TOKENS, "designs": designs, "rows": all_rows, "runs": all_runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results.write(args.out, NAME, result)
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
