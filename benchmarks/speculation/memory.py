"""What one server with per-request speculation saves over one server per profile, in memory.

Run:  .venv/bin/python -m benchmarks.speculation.memory [--out benchmarks/results/memory.json] [--ctx 32768]

Two parts, printed and written to --out:

1. Measured here (CPU): the embedded 0.5B as `serve` launches it — one llama-server with ngram-mod (both profiles
   as per-request settings) against two (`--spec-type none` and `ngram-mod`, today's stock-server design). After one
   warm-up request each, every server's PSS and private RSS (from /proc/PID/smaps_rollup), beside adaptive-spec's
   estimate (llama/memory/sizing.py, from the GGUF's dimensions). On a CPU the mapped GGUF's pages are shared between
   the processes (each is charged half in PSS), so the saving is the second KV cache and compute buffers, not the
   weights.
2. Reasoned from published figures (no GPU here): the public benchmark's Qwen3.6-27B on one GPU held 33,256 MiB with
   no drafter and 38,810 MiB with DFlash at a 262,144-token f16 context. Its attention cache, from the Qwen3.5-27B
   architecture (64 layers of which 16 full attention, 4 KV heads of 256: 64 KiB a token in f16), is 16,384 MiB of
   those at that context; the rest (weights, recurrent state, compute buffers; and the drafter's 5,554 MiB, taken as
   fixed) is held whatever the context. With llama.cpp's default 1,024 MiB margin, the largest context at which one
   server, and two, fit a 24, 32, 48 and 96 GiB card follows (capped at the model's 262,144).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from adaptive_spec.llama.binary.which import find_llama_server
from adaptive_spec.llama.launch import ServerProcess, free_port
from adaptive_spec.llama.memory.gguf_info import model_dims
from adaptive_spec.llama.memory.sizing import MIB, ModelDims, ServerToLaunch, footprint, largest_context
from adaptive_spec.llama.models import ensure_embedded
from benchmarks.harness import results

NAME = "benchmarks.speculation.memory"  # the result file's `benchmark`
CARDS_GIB = (24, 32, 48, 96)
PUBLISHED = {"plain_mib": 33_256, "dflash_mib": 38_810, "ctx": 262_144}
# Qwen3.5-27B: 64 layers, full attention every 4th (16), 4 KV heads of 256 (the 27B recipes' num-query-groups 4,
# kv-channels 256).
QWEN36_27B_KV = ModelDims("Qwen3.6-27B", 0, kv_layers=16, kv_heads=4, key_length=256, value_length=256)


def smaps(pid: int) -> dict[str, int]:
    """PSS and private (clean + dirty) of a process, in bytes."""
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, _, rest = line.partition(":")
        fields[name.strip()] = int(rest.split()[0]) * 1024
    return {"pss": fields["Pss"], "private": fields["Private_Clean"] + fields["Private_Dirty"]}


def _warm(url: str) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 16}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=300).read()


async def measure(binary: str, model: Path, ctx: int, spec_types: list[str], logs: Path) -> list[dict[str, Any]]:
    servers = []
    for i, spec in enumerate(spec_types):
        port = free_port("127.0.0.1")
        argv = [binary, "-m", str(model), "--port", str(port), "-c", str(ctx), "-t", "1", "--jinja"]
        argv += ["--spec-type", spec]
        servers.append(
            ServerProcess(f"s{i}", argv, f"http://127.0.0.1:{port}", logs / f"s{i}.log", say=lambda _m: None)
        )
    try:
        for s in servers:
            await s.start(health_timeout_s=300)
        for s in servers:
            await asyncio.to_thread(_warm, s.base_url)
        out = []
        for s, spec in zip(servers, spec_types, strict=True):
            assert s.process is not None
            out.append({"spec_type": spec, **smaps(s.process.pid)})
        return out
    finally:
        for s in servers:
            await s.stop()


def card_table() -> list[dict[str, Any]]:
    kv_full = QWEN36_27B_KV.kv_bytes_per_token() * PUBLISHED["ctx"]
    fixed = PUBLISHED["dflash_mib"] * MIB - kv_full  # weights, drafter, recurrent state, compute: any context
    server = ModelDims("Qwen3.6-27B + DFlash", round(fixed), 16, 4, 256, 256)
    rows = []
    for gib in CARDS_GIB:
        free = gib * 1024 * MIB
        row: dict[str, Any] = {"card_gib": gib}
        for n in (1, 2):
            servers = [ServerToLaunch(f"s{i}", server, ctx_size=0) for i in range(n)]
            row[f"ctx_{n}_server"] = min(largest_context(servers, free, 1024 * MIB), PUBLISHED["ctx"])
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/memory.json"))
    parser.add_argument("--ctx", type=int, default=32768)
    args = parser.parse_args()
    binary = find_llama_server(None)
    model = Path(ensure_embedded("qwen2.5-coder-0.5b", print))
    dims = model_dims(model)
    estimate = footprint(ServerToLaunch("one", dims, args.ctx)).total_bytes
    with tempfile.TemporaryDirectory() as tmp:
        one = asyncio.run(measure(binary, model, args.ctx, ["ngram-mod"], Path(tmp)))
        two = asyncio.run(measure(binary, model, args.ctx, ["none", "ngram-mod"], Path(tmp)))
    result = {"ctx": args.ctx, "estimate_per_server": estimate, "one_server": one, "two_servers": two}
    result["cards"] = card_table()

    def mib(n: float) -> str:
        return f"{n / MIB:,.0f}"

    print(f"embedded 0.5B, -c {args.ctx}, -t 1 (MiB)     PSS     private   estimate (model + KV)")
    for label, rows in (("one server (per-request)", one), ("two servers (per process)", two)):
        pss, private = sum(r["pss"] for r in rows), sum(r["private"] for r in rows)
        print(f"  {label:<27} {mib(pss):>7}  {mib(private):>8}   {mib(estimate * len(rows)):>8}")
    ratio = sum(r["private"] for r in two) / max(1, sum(r["private"] for r in one))
    print(f"  private memory, two servers / one: {ratio:.2f}x")
    print("\nQwen3.6-27B + DFlash, f16 KV, 1,024 MiB margin (reasoned from the published 38,810 MiB at 262,144 tokens)")
    print("  card     largest context, one server   two servers")
    for row in result["cards"]:
        one_ctx, two_ctx = row["ctx_1_server"], row["ctx_2_server"]
        print(
            f"  {row['card_gib']:>3} GiB  {one_ctx:>12,}                {two_ctx:>12,}"
            + ("  (none)" if not two_ctx else "")
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results.write(args.out, NAME, result)
    print(f"\nwritten: {args.out}")


if __name__ == "__main__":
    main()
