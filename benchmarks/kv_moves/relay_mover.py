"""A KV handoff between two "hosts" through their kv-relays, step by step: a prompt prefilled on server A, then the
relay mover's save on A, the stream from A's relay into B's, the restore on B, and the request on B that follows.

Run:  .venv/bin/python -m benchmarks.kv_moves.relay_mover [--models tiny,qwen] [--tokens 1000,3500]
                                                 [--out benchmarks/results/relay_mover.json]

Both servers run on this machine (loopback, `-t 1`, one slot each, separate slot directories), each relay in its own
process, as a user runs them. Figures are per run; bytes per token is the slot file's size over the tokens it holds.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import aiohttp
from tests.support.processes.relay import RelayProcess
from tests.support.processes.servers import LlamaServer, http_json

from adaptive_spec.kv.movers import MoveRequest, RelayMover
from adaptive_spec.kv.relay_client import RelayClient
from adaptive_spec.kv.slot_files import file_sha256
from adaptive_spec.llama.binary.which import find_llama_server
from adaptive_spec.llama.upstreams import Upstream
from benchmarks.kv_moves.common import KEY, model, prompt, run_main, server_args


async def _move(mover: RelayMover, a: Upstream, b: Upstream, name: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as client:
        try:
            moved = await mover.move(client, MoveRequest(a, 0, b, 0, name, timeout_s=600.0, min_tokens=1))
        finally:
            await mover.discard(name)
    return {
        "tokens": moved.n_saved,
        "slot_file_bytes": moved.bytes,
        "bytes_per_token": round(moved.bytes / max(1, moved.n_saved), 1),
        "save_ms": round(moved.save_s * 1000, 1),
        "transfer_ms": round(moved.transfer_s * 1000, 1),
        "transfer_mb_per_s": round(moved.bytes / max(1e-6, moved.transfer_s) / 1e6, 1),
        "restore_ms": round(moved.restore_s * 1000, 1),
    }


def _one(mover: RelayMover, servers: list[LlamaServer], run: int, chars: int) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": prompt(run, chars), "temperature": 0, "max_tokens": 16, "id_slot": 0}
    prefill = http_json(servers[0].url + "/v1/chat/completions", {**body, "max_tokens": 1}, timeout=3600)["timings"]
    a, b = (Upstream("bench", s.url, replica=i) for i, s in enumerate(servers))
    row = asyncio.run(_move(mover, a, b, f"as-bench-{run}.bin"))
    after = http_json(servers[1].url + "/v1/chat/completions", body, timeout=3600)["timings"]
    return {
        **row,
        "prefill_on_a_ms": round(prefill["prompt_ms"], 1),
        "after_move_on_b": {k: after[k] for k in ("prompt_n", "cache_n", "prompt_ms")},
    }


def bench(models: list[str], tokens: list[int], home: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    binary = find_llama_server(None)
    for model_name in models:
        gguf, chars_per_token = model(model_name, home)
        args = server_args(tokens)
        servers: list[LlamaServer] = []
        relays: list[RelayProcess] = []
        try:
            for side in ("a", "b"):
                slots = home / model_name / side
                slots.mkdir(parents=True)
                servers.append(LlamaServer(binary, gguf, *args, "--slot-save-path", str(slots), log_dir=home / "logs"))
                relays.append(RelayProcess(slots, gguf, KEY, server=servers[-1].url))
            sha = file_sha256(gguf)
            mover = RelayMover({s.url: RelayClient(r.base, KEY, sha) for s, r in zip(servers, relays, strict=True)})
            for run, n in enumerate(tokens):
                rows.append({"model": model_name, **_one(mover, servers, run, int(n * chars_per_token))})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        finally:
            for relay in relays:
                relay.stop()
            for server in servers:
                server.stop()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| model | tokens | bytes/token | save | transfer (MB/s) | restore | then on B | prefill on A |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b = r["after_move_on_b"]
        out.append(
            f"| {r['model']} | {r['tokens']:,} | {r['bytes_per_token']:,.0f} | {r['save_ms']:.1f} ms | "
            f"{r['transfer_ms']:.1f} ms ({r['transfer_mb_per_s']}) | {r['restore_ms']:.1f} ms | {b['prompt_n']} tok, "
            f"{b['prompt_ms']:.0f} ms (cache_n {b['cache_n']:,}) | {r['prefill_on_a_ms']:,.0f} ms |"
        )
    return "\n".join(out)


def main() -> None:
    run_main("benchmarks.kv_moves.relay_mover", __doc__, "benchmarks/results/relay_mover.json", bench, table)


if __name__ == "__main__":
    main()
