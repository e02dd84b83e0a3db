"""What a restored head gives a prompt that parts from it inside its system prompt (a new project), per attention
family, straight on the pinned llama-server (one slot, `-t 1`, `-c 16384`): the first project's turn cold and its slot
saved, the slot erased and the file restored, the second project's turn (its `cache_n` against the tokens the two
prompts share), and the same second turn after that many of its tokens were prefilled alone (the same prefill split:
its greedy text must be equal). Also a head's bytes on disk per saved token against `llama/memory/`'s figures (the
attention KV per token, one context checkpoint) and the store's prior.

Run:  .venv/bin/python -m benchmarks.new_project.families [--families dense,swa,swa-full,hybrid]
      [--shapes late,opencode] [--out FILE.json]

`late`: the two prompts part three quarters in (a short tail after the working directory); `opencode`: a fifth in, as
opencode's working directory sits ~1.8k of ~7.2k tokens in. Models: the embedded Qwen2.5-Coder 0.5B (dense), Gemma 3
270M (sliding window 512; `swa-full`: launched with `--swa-full`) and the tests' tiny random `qwen35` (hybrid).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.support.models.tiny_drafters import write_tiny_mtp_target
from tests.support.processes.servers import free_port, terminate

from adaptive_spec.bench import machine
from adaptive_spec.kv.heads.book import _PRIOR_BYTES_PER_TOKEN
from adaptive_spec.llama.binary.which import find_llama_server
from adaptive_spec.llama.memory.gguf_info import model_dims
from adaptive_spec.llama.models import ensure_embedded
from benchmarks.harness import RESULTS, results

NAME = "benchmarks.new_project.families"
SHAPES = {"late": (36, 20), "opencode": (30, 170)}  # (rule lines before the working directory, tool lines after)


def _messages(shape: str, directory: str) -> list[dict[str, str]]:
    before, after = SHAPES[shape]
    rules = "\n".join(
        f"{i}. Keep function_{i} small, typed and tested; never edit file_{i}.py unread." for i in range(before)
    )
    tail = "\n".join(f"Tool {i}: does thing {i} with a path and a pattern." for i in range(after))
    system = f"You are a coding agent in a repository. Rules:\n{rules}\nWorking directory: {directory}\n{tail}"
    return [{"role": "system", "content": system}, {"role": "user", "content": "Write hello.py that prints hello."}]


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1800) as resp:
        return json.loads(resp.read())


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def _model(family: str, scratch: Path) -> Path:
    if family == "dense":
        return ensure_embedded("qwen2.5-coder-0.5b")
    if family.startswith("swa"):
        return ensure_embedded("gemma3-270m")
    return write_tiny_mtp_target(scratch / "tiny-random-qwen35.gguf")


def measure(family: str, shape: str, scratch: Path) -> dict[str, Any]:
    model, slots, port = _model(family, scratch), scratch / f"slots-{family}-{shape}", free_port()
    slots.mkdir()
    base = f"http://127.0.0.1:{port}"
    args = [find_llama_server(None), "-m", str(model), "--port", str(port), "-t", "1", "-c", "16384", "-np", "1"]
    args += ["--slot-save-path", str(slots), "--jinja", *(["--swa-full"] if family == "swa-full" else [])]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                if _get(base + "/health").get("status") == "ok":
                    break
            except OSError:
                pass
            time.sleep(0.2)

        def turn(messages: list[dict[str, str]]) -> tuple[dict[str, Any], str]:
            body = {"messages": messages, "max_tokens": 32, "temperature": 0, "id_slot": 0}
            reply = _post(base + "/v1/chat/completions", body)
            return reply["timings"], reply["choices"][0]["message"]["content"]

        def ids(messages: list[dict[str, str]]) -> list[int]:
            prompt = _post(base + "/apply-template", {"messages": messages})["prompt"]
            return list(
                _post(base + "/tokenize", {"content": prompt, "add_special": True, "parse_special": True})["tokens"]
            )

        alpha, beta = _messages(shape, "/home/dev/projects/shop"), _messages(shape, "/home/dev/projects/blog")
        cold, _ = turn(alpha)
        saved = _post(base + "/slots/0?action=save", {"filename": "head.bin"})
        size = (slots / "head.bin").stat().st_size
        _post(base + "/slots/0?action=erase", {})
        _post(base + "/slots/0?action=restore", {"filename": "head.bin"})
        warm, warm_text = turn(beta)
        _post(base + "/slots/0?action=erase", {})
        beta_ids = ids(beta)
        if warm["cache_n"]:
            _post(base + "/completion", {"prompt": beta_ids[: warm["cache_n"]], "n_predict": 0, "id_slot": 0})
        split, split_text = turn(beta)
        a_ids = ids(alpha)
        shared = next((i for i, (x, y) in enumerate(zip(a_ids, beta_ids, strict=False)) if x != y), len(a_ids))
    finally:
        terminate(proc, 10.0)
    dims = model_dims(model)
    return {
        "family": family,
        "shape": shape,
        "first_project": {"prompt_n": cold["prompt_n"], "prompt_ms": round(cold["prompt_ms"])},
        "shared_tokens": shared,
        "second_project_restored": {k: warm[k] for k in ("prompt_n", "cache_n")}
        | {"prompt_ms": round(warm["prompt_ms"])},
        "same_split": {k: split[k] for k in ("prompt_n", "cache_n")},
        "greedy_equal": warm_text == split_text and warm["prompt_n"] == split["prompt_n"],
        "head_tokens": saved["n_saved"],
        "head_bytes": size,
        "bytes_per_token": round(size / saved["n_saved"]),
        "memory_kv_bytes_per_token": round(dims.kv_bytes_per_token()),
        "memory_checkpoint_bytes": dims.checkpoint_bytes(16384, 1),
        "store_prior_bytes_per_token": _PRIOR_BYTES_PER_TOKEN,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--families", default="dense,swa,swa-full,hybrid")
    parser.add_argument("--shapes", default="late,opencode")
    parser.add_argument("--out", type=Path, default=RESULTS / "new_project_families.json")
    args = parser.parse_args()
    started, runs = machine.sample(), []
    with tempfile.TemporaryDirectory(prefix="new-project-") as scratch:
        for family in args.families.split(","):
            for shape in args.shapes.split(","):
                runs.append(measure(family, shape, Path(scratch)))
                print(json.dumps(runs[-1]), flush=True)
    print("| family | shape | shared tokens | restored: prompt_n / cache_n | same split equal | head bytes/token |")
    print("|---|---|---|---|---|---|")
    for r in runs:
        w = r["second_project_restored"]
        print(
            f"| {r['family']} | {r['shape']} | {r['shared_tokens']} of {r['first_project']['prompt_n']} | "
            f"{w['prompt_n']} / {w['cache_n']} | {r['greedy_equal']} | {r['bytes_per_token']:,} |"
        )
    print(f"written to {results.write(args.out, NAME, {'runs': runs}, started=started)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
