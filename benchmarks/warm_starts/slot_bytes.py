"""A head's bytes on disk by model family: real slot files (`POST /slots/0?action=save` after a first turn) at a few
prompt lengths, fitted to a fixed part and a part per token by the store's own fit (`kv/heads/matching.py` `head_size`),
beside what `llama/memory/` says of the model (the attention KV per token, one context checkpoint).

Run:  .venv/bin/python -m benchmarks.warm_starts.slot_bytes [--families dense,swa,hybrid] [--lines 30,80,160]
      [--out benchmarks/results/slot_bytes.json]

One llama-server per family (`-t 1`, `-c 16384`, one slot, no speculation): the embedded Qwen2.5-Coder 0.5B (dense),
Gemma 3 270M (sliding window 512) and the tests' tiny random `qwen35` (hybrid: a gated delta net and attention). Each
length is a fresh slot (erased) and a chat turn of a system prompt of that many rule lines and one user message,
`max_tokens` 1, as a head is saved after a first turn (tests/support/processes/slot_files.py). Sizes are the files'
own; token counts are llama-server's `n_saved`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tests.support.models.tiny_drafters import write_tiny_mtp_target
from tests.support.processes.servers import LlamaServer
from tests.support.processes.slot_files import as_entries, slot_files

from adaptive_spec.bench import machine
from adaptive_spec.kv.heads.matching import head_size
from adaptive_spec.llama.binary.which import find_llama_server
from adaptive_spec.llama.memory.gguf_info import model_dims
from adaptive_spec.llama.models import ensure_embedded
from benchmarks.harness import RESULTS, results

NAME = "benchmarks.warm_starts.slot_bytes"
CTX = 16384


def model(family: str, scratch: Path) -> Path:
    if family == "dense":
        return ensure_embedded("qwen2.5-coder-0.5b")
    if family == "swa":
        return ensure_embedded("gemma3-270m")
    return write_tiny_mtp_target(scratch / "tiny-random-qwen35.gguf")


def measure(family: str, lengths: Sequence[int], scratch: Path) -> dict[str, Any]:
    path, slots = model(family, scratch), scratch / f"slots-{family}"
    slots.mkdir()
    args = ("-c", str(CTX), "--parallel", "1", "--spec-type", "none", "--slot-save-path", str(slots))
    server = LlamaServer(find_llama_server(None), path, *args, log_dir=scratch / f"logs-{family}")
    try:
        files = slot_files(server, slots, lengths)
    finally:
        server.stop()
    fit = head_size(as_entries(files), 0.0)
    dims = model_dims(path)
    return {
        "family": family,
        "model": path.name,
        "files": [asdict(f) | {"fitted_bytes": fit.bytes_for(f.tokens)} for f in files],
        "fitted_fixed_bytes": round(fit.fixed_bytes),
        "fitted_bytes_per_token": round(fit.bytes_per_token, 1),
        "memory_kv_bytes_per_token": round(dims.kv_bytes_per_token()),
        "memory_checkpoint_bytes": dims.checkpoint_bytes(CTX, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--families", default="dense,swa,hybrid")
    parser.add_argument("--lines", default="30,80,160", help="the system prompt's rule lines, one slot file each")
    parser.add_argument("--out", type=Path, default=RESULTS / "slot_bytes.json")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lines.split(",")]
    started, runs, t0 = machine.sample(), [], time.monotonic()
    with tempfile.TemporaryDirectory(prefix="slot-bytes-") as scratch:
        for family in args.families.split(","):
            runs.append(measure(family, lengths, Path(scratch)))
            print(json.dumps(runs[-1]), flush=True)
    print("| family | tokens | file bytes | fitted | fitted fixed + per token | memory: KV per token, checkpoint |")
    print("|---|---|---|---|---|---|")
    for r in runs:
        for f in r["files"]:
            print(
                f"| {r['family']} | {f['tokens']:,} | {f['bytes']:,} | {f['fitted_bytes']:,} | "
                f"{r['fitted_fixed_bytes']:,} + {r['fitted_bytes_per_token']:,} | "
                f"{r['memory_kv_bytes_per_token']:,}, {r['memory_checkpoint_bytes']:,} |"
            )
    print(f"{time.monotonic() - t0:.0f} s; written to {results.write(args.out, NAME, {'runs': runs}, started=started)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
