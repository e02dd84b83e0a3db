"""What `--no-repack` costs: prefill and decode speed of the embedded models with llama.cpp's CPU weight repacking on
and off, on this machine.

Run:  .venv/bin/python -m benchmarks.cpu.repack_cost [--rounds 3] [--models qwen2.5-coder-0.5b,qwen2.5-coder-1.5b]
      [--out benchmarks/results/repack_cost.json]

Both servers of a model run side by side (`-t 1`, one slot, no speculation), started by the product's own
ServerProcess with `--cpu-repack`'s two fixed modes (always: repacking on; never: `--no-repack`). Each round sends
every server the same fresh prompt (~1,000 tokens, so it is prefilled whole) and 64 greedy tokens, in alternating
order; llama-server's own `timings` give prompt and predicted tokens per second. Printed and written: the median of
each, and off/on side by side. A machine that faults on repacking (AMX on some VMs) cannot run the "on" side: its
server fails to start, and that is said.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from adaptive_spec.errors import LaunchError
from adaptive_spec.llama.binary.cpu_faults import RepackMode, VerdictStore
from adaptive_spec.llama.binary.which import find_llama_server
from adaptive_spec.llama.launch import ServerProcess, free_port
from adaptive_spec.llama.models import ensure_embedded
from benchmarks.harness import results

NAME = "benchmarks.cpu.repack_cost"  # the result file's `benchmark`
MODES: tuple[RepackMode, ...] = ("always", "never")  # repacking on, off


def _prompt(round_: int) -> str:
    lines = [f"def f_{round_}_{i}(x):\n    return x * {i} + {round_}" for i in range(60)]
    return "Here is a module:\n" + "\n".join(lines) + "\nExplain what f_0 does."


def _ask(url: str, prompt: str) -> dict[str, Any]:
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 64,
        "temperature": 0,
        "cache_prompt": False,
    }
    req = urllib.request.Request(
        url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        timings: dict[str, Any] = json.loads(resp.read())["timings"]
    return timings


async def _start(binary: str, model: Path, mode: RepackMode, logs: Path) -> ServerProcess:
    port = free_port("127.0.0.1")
    argv = [binary, "-m", str(model), "--port", str(port), "-c", "4096", "-t", "1", "--parallel", "1", "--jinja"]
    server = ServerProcess(
        f"repack-{mode}", argv, f"http://127.0.0.1:{port}", logs / f"{model.stem}-{mode}.log", say=lambda _m: None,
        repack=mode, verdicts=VerdictStore(logs / "verdicts.json"),
    )  # fmt: skip
    await server.start(health_timeout_s=300)
    return server


async def measure(binary: str, model: Path, rounds: int, logs: Path) -> dict[str, Any]:
    servers: dict[str, ServerProcess] = {}  # by repack mode
    result: dict[str, Any] = {"model": model.name}
    try:
        for mode in MODES:
            try:
                servers[mode] = await _start(binary, model, mode, logs)
            except LaunchError as exc:
                result[f"{mode}_error"] = str(exc).splitlines()[0]
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
        for r in range(rounds + 1):  # round 0 warms each server up and is not counted
            order = list(servers) if r % 2 else list(reversed(servers))
            for name in order:
                timings = await asyncio.to_thread(_ask, servers[name].base_url, _prompt(r))
                if r:
                    runs[name].append(timings)
        for name, got in runs.items():
            result[name] = {
                "prefill_tps": statistics.median(t["prompt_per_second"] for t in got),
                "decode_tps": statistics.median(t["predicted_per_second"] for t in got),
                "prompt_n": statistics.median(t["prompt_n"] for t in got),
            }
        if "always" in result and "never" in result:
            result["off_over_on"] = {k: result["never"][k] / result["always"][k] for k in ("prefill_tps", "decode_tps")}
        return result
    finally:
        for server in servers.values():
            await server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/repack_cost.json"))
    args = parser.parse_args()
    binary = find_llama_server(None)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            model = Path(ensure_embedded(name, print))
            runs.append(asyncio.run(measure(binary, model, args.rounds, Path(tmp))))
    print(f"{'model':<44} {'repack':<7} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for row in runs:
        for mode, label in (("always", "on"), ("never", "off")):
            if mode in row:
                print(
                    f"{row['model']:<44} {label:<7} {row[mode]['prefill_tps']:>14.1f} {row[mode]['decode_tps']:>13.1f}"
                )
            else:
                print(f"{row['model']:<44} {label:<7} failed: {row.get(mode + '_error')}")
        if "off_over_on" in row:
            ratio = row["off_over_on"]
            print(f"{'':<44} off/on  {ratio['prefill_tps']:>14.2f} {ratio['decode_tps']:>13.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results.write(args.out, NAME, {"rounds": args.rounds, "threads": 1, "results": runs})
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
