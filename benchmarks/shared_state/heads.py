"""A head across proxies: an agent's first turn prefilled cold through one `serve`, the head it left restored for a
new session through the same proxy, and through another proxy sharing one real redis-server (`--shared-state`), which
took the head from the first proxy's folder when it was told of it.

Run:  .venv/bin/python -m benchmarks.shared_state.heads [--model tiny|qwen] [--rounds 3] [--out F]

One real llama-server (`-t 1`, one slot, no speculation; the tests' tiny random-weight model, or the real
Qwen2.5-Coder-0.5B with `--model qwen`), two proxies with state directories of their own on this host. Each round is a
new system prompt (a new head): its first turn through proxy a (cold), the slot erased, a new session through a (a
restores its own head), the slot erased, a new session through b; each erase through proxy a's
`/adaptive/profiles/plain/erase` (so both proxies know the slot is empty). Per path: the time per request as the client
saw it, llama-server's `prompt_n` and `cache_n`, and whether the record's reason says a head was restored; and how long
after a's answer b listed the head (a's save, the news, b's copy and checksum).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.support.models.tiny_gguf import write_tiny_gguf
from tests.support.processes.redis import RedisServer
from tests.support.processes.servers import LlamaServer, ProxyProcess, http_json

from adaptive_spec.bench import machine
from adaptive_spec.llama.binary.which import find_llama_server
from adaptive_spec.llama.models import ensure_embedded
from benchmarks.harness import RESULTS, results
from benchmarks.harness.stats import median

NAME = "shared_state_heads"
PATHS = ("cold", "restored through the same proxy", "restored through the other proxy")


def system_prompt(round_: int) -> str:
    rules = "\n".join(
        f"{i}. Keep function_{i} of team {round_} small, typed and tested; never edit file_{i}.py unread."
        for i in range(40)
    )
    return f"You are coding agent number {round_}. Rules:\n{rules}"


def first_turn(proxy: ProxyProcess, system: str, session: str) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Write hello.py."}]
    body = {"model": "m", "messages": messages, "temperature": 0, "seed": 1, "max_tokens": 8}
    req = urllib.request.Request(
        proxy.base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "x-session-id": session},
    )
    started = time.perf_counter()
    with urllib.request.urlopen(req, timeout=600) as resp:
        answer = json.loads(resp.read())
        request_id = resp.headers["x-adaptive-spec-request-id"]
    ms = (time.perf_counter() - started) * 1000
    record = next(r for r in proxy.requests() if r["request_id"] == request_id)
    timings = answer["timings"]
    warm = "warm: head of" in str(record["reason"])
    return {"ms": round(ms, 1), "prompt_n": timings["prompt_n"], "cache_n": timings["cache_n"], "restored": warm}


def _until_listed(proxy: ProxyProcess, count: int, since: float) -> float:
    deadline = time.monotonic() + 120
    while len(http_json(proxy.base + "/adaptive/heads")["heads"]) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proxy.base} never listed {count} heads:\n{proxy.log()}")
        time.sleep(0.02)
    return round((time.perf_counter() - since) * 1000, 1)


def _round(a: ProxyProcess, b: ProxyProcess, round_: int) -> dict[str, Any]:
    system = system_prompt(round_)
    cold = first_turn(a, system, f"a-{round_}")
    answered = time.perf_counter()
    _until_listed(a, round_ + 1, answered)
    taken_ms = _until_listed(b, round_ + 1, answered)
    erase = a.base + "/adaptive/profiles/plain/erase"  # through a proxy: both know the slot is empty
    http_json(erase, {})
    same = first_turn(a, system, f"a2-{round_}")
    http_json(erase, {})
    other = first_turn(b, system, f"b-{round_}")
    http_json(erase, {})
    return {"taken_ms": taken_ms, **dict(zip(PATHS, (cold, same, other), strict=True))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("tiny", "qwen"), default="tiny")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "shared_state_heads.json")
    args = parser.parse_args()
    started = machine.sample()
    with tempfile.TemporaryDirectory(prefix="shared-heads-bench-") as tmp:
        home = Path(tmp)
        model = write_tiny_gguf(home / "tiny.gguf") if args.model == "tiny" else ensure_embedded("qwen2.5-coder-0.5b")
        (home / "slots").mkdir()
        server_args = ("-c", "8192", "--parallel", "1", "--spec-type", "none", "--slot-save-path", str(home / "slots"))
        server = LlamaServer(find_llama_server(None), model, *server_args, log_dir=home)
        redis_server = RedisServer(home)
        proxies: list[ProxyProcess] = []
        try:
            for name in ("a", "b"):
                env = {"ADAPTIVE_SPEC_STATE_DIR": str(home / name), "ADAPTIVE_SPEC_CONFIG_DIR": str(home / name)}
                args_ = ("--profile", f"plain={server.url}", "--slot-dir", str(home / "slots"))
                proxies.append(ProxyProcess(*args_, "--shared-state", redis_server.url, env=env))
            rounds = [_round(proxies[0], proxies[1], r) for r in range(args.rounds)]
        finally:
            for proxy in proxies:
                proxy.stop()
            redis_server.stop()
            server.stop()
    out: dict[str, Any] = {"rounds": rounds, "taken_ms_median": median([r["taken_ms"] for r in rounds])}
    print(
        f"\n{args.model}: {args.rounds} rounds; b listed the head a median {out['taken_ms_median']} ms after a's answer"
    )
    print("| path | time per request, median (each) | `prompt_n` | `cache_n` | reason says restored |")
    print("|---|---|---|---|---|")
    for path in PATHS:
        ms = [r[path]["ms"] for r in rounds]
        out[path] = {"ms_median": median(ms)}
        restored = sum(r[path]["restored"] for r in rounds)
        print(
            f"| {path} | {median(ms)} ms ({', '.join(map(str, ms))}) | {rounds[0][path]['prompt_n']} "
            f"| {rounds[0][path]['cache_n']} | {restored} of {len(rounds)} |"
        )
    extra = {"args": vars(args), "model": args.model}
    print(f"written to {results.write(args.out, NAME, {**out, **extra}, started=started)}")


if __name__ == "__main__":
    main()
