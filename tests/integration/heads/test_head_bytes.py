"""A head's size before it is saved (`kv/heads/matching.py` `head_size`) against real slot files of the pinned
llama-server, per family: fitted to the files of the shortest and the longest of three first turns, it gives the
middle one's bytes. A sliding-window or hybrid file holds a fixed part besides the KV per token (the window's cache
and a checkpoint of it; the recurrent state and its checkpoints), which the short file's mean bytes per token would
spread over a longer head; a dense file is the KV per token alone.

Gemma's lengths are past its window and a ubatch (1,024 tokens): below that the window's layers grow with the prompt
too, and the file is not yet a line (docs/benchmarks.md "Bytes and memory")."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from adaptive_spec.kv.heads.matching import head_size
from adaptive_spec.llama.memory.gguf_info import model_dims
from tests.support.models.tiny_drafters import write_tiny_mtp_target
from tests.support.processes.servers import LlamaServer
from tests.support.processes.slot_files import SlotFile, as_entries, slot_files


def _files(binary: str, model: Path, lines: Sequence[int], tmp_path: Path) -> list[SlotFile]:
    slots = tmp_path / "slots"
    slots.mkdir()
    args = ("-c", "16384", "--parallel", "1", "--spec-type", "none", "--slot-save-path", str(slots))
    server = LlamaServer(binary, model, *args, log_dir=tmp_path / "logs")
    try:
        return slot_files(server, slots, lines)
    finally:
        server.stop()


def _fits(files: list[SlotFile], model: Path, fixed_at_least: float) -> None:
    short, middle, long = files
    fit = head_size(as_entries([short, long]), 0.0)
    assert fit.bytes_for(middle.tokens) == pytest.approx(middle.bytes, rel=0.002), (files, fit)
    assert fit.fixed_bytes >= fixed_at_least, (files, fit)
    dims = model_dims(model)
    # Every token's KV of the layers that keep them all (the file adds each cell's position and sequences).
    assert dims.full_kv_bytes_per_token() <= fit.bytes_per_token < dims.full_kv_bytes_per_token() * 1.2, fit
    if fixed_at_least:  # the short head's mean per token, as the store sized heads before: the long one overstated
        assert head_size(as_entries([short]), 0.0).bytes_for(long.tokens) > long.bytes * 1.01


def test_a_hybrid_head_is_a_fixed_part_and_a_part_per_token(llama_server_binary: str, tmp_path: Path) -> None:
    model = write_tiny_mtp_target(tmp_path / "tiny-random-qwen35-mtp.gguf")
    files = _files(llama_server_binary, model, (30, 80, 160), tmp_path)  # byte tokens: 2,294 to 12,094
    _fits(files, model, fixed_at_least=model_dims(model).checkpoint_bytes(16384, 1))  # the recurrent state


def test_a_sliding_window_head_is_a_fixed_part_and_a_part_per_token(
    llama_server_binary: str, gemma_gguf: Path, tmp_path: Path
) -> None:
    files = _files(llama_server_binary, gemma_gguf, (60, 100, 140), tmp_path)
    assert files[0].tokens > 1024
    _fits(files, gemma_gguf, fixed_at_least=model_dims(gemma_gguf).checkpoint_bytes(16384, 1))  # the window's cache


def test_a_dense_head_is_bytes_per_token(llama_server_binary: str, qwen_gguf: Path, tmp_path: Path) -> None:
    files = _files(llama_server_binary, qwen_gguf, (20, 40, 80), tmp_path)
    _fits(files, qwen_gguf, fixed_at_least=0)
