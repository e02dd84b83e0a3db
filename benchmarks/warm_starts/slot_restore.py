"""What a slot restore keeps on a hybrid target: `cache_n` of the next turn after a save on one llama-server and a
restore on another, beside the same turn on the server that kept its slot, for each binary given.

Run:  .venv/bin/python -m benchmarks.warm_starts.slot_restore --binary PATH [--binary PATH ...] [--rounds 3]
      [--out benchmarks/results/slot_restore.json]

The target is the tests' tiny random-weight `qwen35` model (layer 0 a gated delta net, layer 1 attention, as in
Qwen3.5/3.6: tests/support/models/tiny_drafters.py). Two servers per binary (`-t 1`, one slot, no speculation, one slot
directory). Each round is a fresh conversation: turn 1 on server A, `POST /slots/0?action=save` there,
`?action=restore` on server B, then turn 2 (turn 1, its reply and a new question) on B, and the same turn 2 on A.
A recurrent state cannot be rolled back to a shorter prefix, so without the context checkpoints in the slot file the
restored server re-prefills all of it (`cache_n` 0); with them it resumes from the last checkpoint. Everything
printed is llama-server's own `timings` and slot-action answers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from tests.support.models.tiny_drafters import write_tiny_mtp_target
from tests.support.processes.servers import LlamaServer

from benchmarks.harness import results

NAME = "benchmarks.warm_starts.slot_restore"  # the result file's `benchmark`


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
    return answer


def _turn(server: LlamaServer, messages: list[dict[str, str]]) -> dict[str, Any]:
    body = {"messages": messages, "max_tokens": 24, "temperature": 0, "seed": 1, "id_slot": 0}
    return _post(server.url + "/v1/chat/completions", body)


def _conversation(round_: int) -> list[dict[str, str]]:
    code = "\n".join(f"value_{round_}_{i} = {i} * {i}" for i in range(60))
    return [{"role": "user", "content": f"Round {round_}. Here is a.py:\n```python\n{code}\n```\nWhat is it?"}]


def _round(a: LlamaServer, b: LlamaServer, slots: Path, round_: int) -> dict[str, Any]:
    history = _conversation(round_)
    first = _turn(a, history)
    name = f"round-{round_}.bin"
    saved = _post(a.url + "/slots/0?action=save", {"filename": name})
    restored = _post(b.url + "/slots/0?action=restore", {"filename": name})
    history += [
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And what is value_3?"},
    ]
    moved = _turn(b, history)["timings"]
    kept = _turn(a, history)["timings"]
    return {
        "turn1_context": first["timings"]["prompt_n"] + first["timings"].get("cache_n", 0),
        "saved_tokens": saved.get("n_saved"),
        "restored_tokens": restored.get("n_restored"),
        "slot_file_bytes": (slots / name).stat().st_size,
        "restored_cache_n": moved.get("cache_n", 0),
        "restored_prompt_n": moved["prompt_n"],
        "kept_cache_n": kept.get("cache_n", 0),
        "kept_prompt_n": kept["prompt_n"],
    }


def measure(binary: str, rounds: int, home: Path) -> dict[str, Any]:
    model = write_tiny_mtp_target(home / "tiny-random-qwen35-mtp.gguf")
    slots = home / "slots"
    slots.mkdir()
    args = ("-c", "8192", "--parallel", "1", "--spec-type", "none", "--slot-save-path", str(slots))
    version = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30, check=False)
    a = LlamaServer(binary, model, *args, log_dir=home / "logs")
    try:
        b = LlamaServer(binary, model, *args, log_dir=home / "logs")
        try:
            runs = [_round(a, b, slots, r) for r in range(rounds)]
        finally:
            b.stop()
    finally:
        a.stop()
    medians = {key: statistics.median(r[key] for r in runs) for key in runs[0] if runs[0][key] is not None}
    lines = (version.stdout + version.stderr).strip().splitlines()
    return {"binary": binary, "version": lines[-2:] if lines else [], "rounds": runs, "median": medians}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--binary", action="append", required=True, help="a llama-server binary; repeatable")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/slot_restore.json"))
    args = parser.parse_args()
    runs = []
    for binary in args.binary:
        with tempfile.TemporaryDirectory(prefix="slot-restore-") as tmp:
            runs.append(measure(binary, args.rounds, Path(tmp)))
    keys = ("turn1_context", "restored_tokens", "restored_cache_n", "restored_prompt_n", "kept_cache_n")
    print(f"{'binary':<60} " + " ".join(f"{k:>18}" for k in keys))
    for result in runs:
        median = result["median"]
        print(f"{result['binary'][-60:]:<60} " + " ".join(f"{median.get(k, '-'):>18}" for k in keys))
        print(f"  {' | '.join(result['version'])}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results.write(args.out, NAME, {"binaries": runs})
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
