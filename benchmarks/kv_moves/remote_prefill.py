"""Remote prefill, step by step: prefill + save on a "remote" llama-server through its kv-relay, the download, the
restore on a local llama-server, the local request that follows; beside a plain local prefill of the same prompt.

Run:  .venv/bin/python -m benchmarks.kv_moves.remote_prefill [--models tiny,qwen] [--tokens 1000,3500]
                                                     [--out benchmarks/results/remote_prefill.json]

Both servers run on this machine (loopback, `-t 1`, one slot each, separate slot directories); the relay is its own
process, as a user runs it. Each prompt starts with its own line, so the remote prefills all of it. Figures are per
run; bytes per token is the slot file's size over the tokens it holds.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from tests.support.processes.relay import RelayProcess
from tests.support.processes.servers import LlamaServer, http_json

from adaptive_spec.kv.relay_client import RelayClient
from adaptive_spec.kv.slot_files import file_sha256
from adaptive_spec.kv.slots import slot_action
from adaptive_spec.llama.binary.which import find_llama_server
from adaptive_spec.llama.upstreams import Upstream
from benchmarks.kv_moves.common import KEY, model, prompt, run_main, server_args


async def _one(relay: RelayClient, local: LlamaServer, local_slots: Path, run: int, chars: int) -> dict[str, Any]:
    messages = prompt(run, chars)
    body: dict[str, Any] = {"messages": messages, "temperature": 0, "max_tokens": 16}
    name = f"as-pp-bench-{run}.bin"
    async with aiohttp.ClientSession() as client:
        t0 = time.perf_counter()
        pre = await relay.prefill(client, "/v1/chat/completions", body, name, timeout_s=3600)
        t1 = time.perf_counter()
        got = await relay.download(client, name, local_slots / name, 1 << 40, timeout_s=3600)
        t2 = time.perf_counter()
        restored = await slot_action(
            client, Upstream("local", local.url), 0, "restore", name, aiohttp.ClientTimeout(total=600)
        )
        t3 = time.perf_counter()
        await relay.delete(client, name)
    (local_slots / name).unlink()
    after = http_json(local.url + "/v1/chat/completions", body, timeout=3600)["timings"]
    plain = http_json(local.url + "/v1/chat/completions", {**body, "cache_prompt": False}, timeout=3600)["timings"]
    return {
        "tokens": pre.n_saved,
        "slot_file_bytes": got.bytes,
        "bytes_per_token": round(got.bytes / max(1, pre.n_saved), 1),
        "remote_prefill_ms": round(pre.prompt_ms, 1),
        "save_ms": round(pre.save_ms, 2),
        "prefill_call_ms": round((t1 - t0) * 1000, 1),
        "transfer_ms": round((t2 - t1) * 1000, 1),
        "transfer_mb_per_s": round(got.bytes / max(1e-6, t2 - t1) / 1e6, 1),
        "restore_ms": round((t3 - t2) * 1000, 1),
        "restore_server_ms": (restored.get("timings") or {}).get("restore_ms"),
        "after_restore": {"prompt_n": after["prompt_n"], "cache_n": after["cache_n"], "prompt_ms": after["prompt_ms"]},
        "local_prefill_ms": round(plain["prompt_ms"], 1),
        "remote_path_ms": round((t3 - t0) * 1000 + after["prompt_ms"], 1),
    }


def bench(models: list[str], tokens: list[int], home: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    binary = find_llama_server(None)
    for model_name in models:
        gguf, chars_per_token = model(model_name, home)
        remote_slots, local_slots = home / model_name / "remote", home / model_name / "local"
        remote_slots.mkdir(parents=True)
        local_slots.mkdir()
        args = server_args(tokens)
        remote = LlamaServer(binary, gguf, *args, "--slot-save-path", str(remote_slots), log_dir=home / "logs")
        local = LlamaServer(binary, gguf, *args, "--slot-save-path", str(local_slots), log_dir=home / "logs")
        relay_proc = RelayProcess(remote_slots, gguf, KEY, server=remote.url)
        try:
            relay = RelayClient(relay_proc.base, KEY, file_sha256(gguf))
            for run, n in enumerate(tokens):
                row = asyncio.run(_one(relay, local, local_slots, run, int(n * chars_per_token)))
                rows.append({"model": model_name, **row})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        finally:
            relay_proc.stop()
            remote.stop()
            local.stop()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| model | tokens | bytes/token | remote prefill | save | transfer (MB/s) | restore | tail prefill "
        "| local prefill |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a = r["after_restore"]
        out.append(
            f"| {r['model']} | {r['tokens']:,} | {r['bytes_per_token']:,.0f} | {r['remote_prefill_ms']:,.0f} ms | "
            f"{r['save_ms']:.1f} ms | {r['transfer_ms']:.1f} ms ({r['transfer_mb_per_s']}) | {r['restore_ms']:.1f} ms"
            f" | {a['prompt_n']} tok, {a['prompt_ms']:.0f} ms (cache_n {a['cache_n']:,}) "
            f"| {r['local_prefill_ms']:,.0f} ms |"
        )
    return "\n".join(out)


def main() -> None:
    run_main("benchmarks.kv_moves.remote_prefill", __doc__, "benchmarks/results/remote_prefill.json", bench, table)


if __name__ == "__main__":
    main()
