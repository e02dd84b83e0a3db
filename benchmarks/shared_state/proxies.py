"""More than one proxy, side by side in one run: one `serve`; two that share nothing; two (and three) sharing one
real redis-server (`--shared-state`). Each in front of the same two real llama-servers (the tiny random-weight model,
two slots each, no RAM prompt cache), replaying agent-like conversations with every turn sent to a proxy drawn at
random (seeded, so every setup gets the same draws).

Run:  .venv/bin/python -m benchmarks.shared_state.proxies [--conversations 4] [--turns 4] [--rounds 3] [--out F]

All the setups' proxies run at once and take the replays in turn, round by round. Per setup: affinity (the share of
follow-up turns whose prompt llama-server found in the slot: `cache_n` at least the previous turn's whole prompt), the
follow-up turns' `prompt_n` (median, and the sum beside one proxy's), and the time per request as the client saw it
(p50/p99, over every turn of every round). The slots are erased before each replay, so each starts cold. What the shared
state adds is the time column read beside one proxy's: the tiny model answers in milliseconds, so the proxy's own work
is a visible part of it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.models.tiny_gguf import write_tiny_gguf
from tests.support.processes.redis import RedisServer
from tests.support.processes.servers import LlamaServer, ProxyProcess, http_json

from adaptive_spec.bench import machine
from adaptive_spec.llama.binary.which import find_llama_server
from benchmarks.harness import RESULTS, results
from benchmarks.harness.stats import median, percentile

NAME = "shared_state_proxies"
SERVER_ARGS = ("-c", "4096", "--parallel", "2", "--spec-type", "none", "--cache-ram", "0")


@dataclass(frozen=True)
class Turn:
    started: float  # time.monotonic() when it was sent
    seconds: float
    prompt_n: int
    cache_n: int
    via: str


def post(proxy: ProxyProcess, body: dict[str, Any], headers: dict[str, str]) -> tuple[dict[str, Any], float]:
    req = urllib.request.Request(
        proxy.base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    started = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as resp:
        answer = json.loads(resp.read())
    return answer, time.perf_counter() - started


def _conversation(proxies: list[ProxyProcess], n: int, turns: int, seed: int) -> list[Turn]:
    rng = random.Random(seed * 1000 + n)
    history: list[dict[str, str]] = [{"role": "user", "content": f"Conversation {n}: write a function number {n}."}]
    headers = {"x-session-id": f"bench-{seed}-{n}"}
    out = []
    for turn in range(turns):
        proxy = proxies[rng.randrange(len(proxies))]
        body = {"model": "m", "messages": history, "temperature": 0, "seed": 1, "max_tokens": 24}
        started = time.monotonic()
        answer, seconds = post(proxy, body, headers)
        timings = answer["timings"]
        out.append(Turn(started, seconds, int(timings["prompt_n"]), int(timings["cache_n"]), proxy.base))
        text = answer["choices"][0]["message"]["content"]
        history = [*history, {"role": "assistant", "content": text}, {"role": "user", "content": f"Now step {turn}."}]
    return out


def erase(servers: list[LlamaServer]) -> None:
    for server in servers:
        for slot in range(2):
            http_json(f"{server.url}/slots/{slot}?action=erase", {})


def _replay(
    proxies: list[ProxyProcess], servers: list[LlamaServer], args: argparse.Namespace, seed: int
) -> list[list[Turn]]:
    erase(servers)
    with ThreadPoolExecutor(args.conversations) as pool:
        return list(pool.map(lambda n: _conversation(proxies, n, args.turns, seed), range(args.conversations)))


def figures(replays: list[list[list[Turn]]], since: float = 0.0) -> dict[str, Any]:
    """The figures of the turns sent from `since` on (a follow-up counted where it was sent then)."""
    turns = [t for replay in replays for conversation in replay for t in conversation if t.started >= since]
    follow_ups = [
        (before, after)
        for replay in replays
        for conversation in replay
        for before, after in itertools.pairwise(conversation)
        if after.started >= since
    ]
    kept = [after.cache_n >= before.prompt_n + before.cache_n for before, after in follow_ups]
    crossed = [before.via != after.via for before, after in follow_ups]
    ms = [t.seconds * 1000 for t in turns]
    return {
        "requests": len(turns),
        "follow_ups": len(follow_ups),
        "affinity": round(sum(kept) / len(kept), 3) if kept else None,
        "follow_ups_to_another_proxy": sum(crossed),
        "follow_up_prompt_n_median": median([after.prompt_n for _, after in follow_ups]),
        "follow_up_prompt_n_sum": sum(after.prompt_n for _, after in follow_ups),
        "ms_p50": round(percentile(ms, 0.5) or 0.0, 1),
        "ms_p99": round(percentile(ms, 0.99) or 0.0, 1),
    }


def tiny_servers(home: Path, binary: str) -> list[LlamaServer]:
    """The two tiny-model llama-servers the replays run on, each with a slot folder of its own under `home`."""
    model = write_tiny_gguf(home / "tiny.gguf")
    for i in range(2):
        (home / f"slots{i}").mkdir()
    return [
        LlamaServer(binary, model, *SERVER_ARGS, "--slot-save-path", str(home / f"slots{i}"), log_dir=home)
        for i in range(2)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=4, help="side by side (4: one slot each)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="replays per setup, each with other draws")
    parser.add_argument("--out", type=Path, default=RESULTS / "shared_state_proxies.json")
    args = parser.parse_args()
    started = machine.sample()
    binary = find_llama_server(None)
    with tempfile.TemporaryDirectory(prefix="shared-state-bench-") as tmp:
        home = Path(tmp)
        servers = tiny_servers(home, binary)
        redis_server = RedisServer(home)
        db = redis_server.url.rsplit("/", 1)[0]  # each shared setup a database of its own: none reads another's
        setups = {
            "one proxy": (1, ()),
            "two proxies, nothing shared": (2, ()),
            "two proxies, Redis": (2, ("--shared-state", f"{db}/1")),
            "three proxies, Redis": (3, ("--shared-state", f"{db}/2")),
        }
        profile = [a for s in servers for a in ("--profile", f"plain={s.url}")]
        running: dict[str, list[ProxyProcess]] = {}
        out: dict[str, Any] = {}
        try:
            for name, (count, extra) in setups.items():  # every proxy of every setup up at once
                running[name] = [
                    ProxyProcess(
                        *profile,
                        "--tokenizer",
                        "off",
                        "--no-heads",
                        *extra,
                        env={
                            "ADAPTIVE_SPEC_STATE_DIR": str(home / name / f"state{i}"),
                            "ADAPTIVE_SPEC_CONFIG_DIR": str(home / name / f"config{i}"),
                        },
                    )
                    for i in range(count)
                ]
            replays: dict[str, list[list[list[Turn]]]] = {name: [] for name in setups}
            for proxies in running.values():
                _replay(proxies, servers, args, seed=0)  # warm-up: connections, first runs of the code
            for r in range(args.rounds):  # the setups in turn, round by round: the machine's load falls on each alike
                for name, proxies in running.items():
                    replays[name].append(_replay(proxies, servers, args, seed=r + 1))
            for name in setups:
                out[name] = figures(replays[name])
                print(name, out[name], flush=True)
        finally:
            for proxies in running.values():
                for proxy in proxies:
                    proxy.stop()
            redis_server.stop()
            for server in servers:
                server.stop()
    base = out["one proxy"]["ms_p50"]
    print("\n| setup | affinity | follow-ups to another proxy | follow-up `prompt_n` median (sum) | p50 ms | p99 ms |")
    print("|---|---|---|---|---|---|")
    for name, f in out.items():
        ratio = f" ({f['ms_p50'] / base:.2f}×)" if base else ""
        print(
            f"| {name} | {f['affinity']:.0%} | {f['follow_ups_to_another_proxy']} of {f['follow_ups']} "
            f"| {f['follow_up_prompt_n_median']} ({f['follow_up_prompt_n_sum']}) | {f['ms_p50']}{ratio} "
            f"| {f['ms_p99']} |"
        )
    print(f"written to {results.write(args.out, NAME, {'setups': out, 'args': vars(args)}, started=started)}")


if __name__ == "__main__":
    main()
