"""The memory estimate against llama-server's own figures: the KV cache it allocates (its `llama_kv_cache: size =`
line) equals what llama/memory/plan.py computes from the GGUF's header, for a dense and a hybrid tiny model and for
Gemma 3 270M's real sliding-window weights (two cache lines: the full layers' and the window's); the hybrid's
recurrent state is close to its `llama_memory_recurrent: size =` line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from adaptive_spec.llama.memory.gguf_info import model_dims
from adaptive_spec.llama.memory.plan import MIB, ServerPlan, footprint
from tests.support.models.tiny_drafters import write_tiny_mtp_target
from tests.support.processes.servers import LlamaServer


def _logged_mib(log: str, what: str) -> float:
    found = re.search(rf"{what}: size =\s+([0-9.]+) MiB", log)
    assert found, f"no '{what}: size =' line in the log"
    return float(found.group(1))


@pytest.mark.parametrize("kind", ["dense", "hybrid"])
def test_the_kv_estimate_equals_what_llama_server_allocates(
    kind: str, llama_server_binary: str, tiny_gguf: Path, tmp_path: Path
) -> None:
    model = tiny_gguf if kind == "dense" else write_tiny_mtp_target(tmp_path / "tiny-random-qwen35-mtp.gguf")
    server = LlamaServer(llama_server_binary, model, "-c", "8192", "--parallel", "2", "-v", log_dir=tmp_path / "logs")
    try:
        log = server.log_path.read_text()
    finally:
        server.stop()
    estimate = footprint(ServerPlan("s", model_dims(model), 8192, slots=2))
    assert _logged_mib(log, "llama_kv_cache") == pytest.approx(estimate.kv_bytes / MIB, abs=0.005)
    if kind == "hybrid":
        logged = _logged_mib(log, "llama_memory_recurrent")
        assert estimate.recurrent_bytes > 0
        assert logged / 2 <= estimate.recurrent_bytes / MIB <= logged * 2


def test_the_sliding_window_estimate_equals_both_of_llama_server_s_caches(
    llama_server_binary: str, gemma_gguf: Path, tmp_path: Path
) -> None:
    server = LlamaServer(
        llama_server_binary, gemma_gguf, "-c", "8192", "--parallel", "2", "-v", log_dir=tmp_path / "logs"
    )
    try:
        log = server.log_path.read_text()
    finally:
        server.stop()
    # The full layers' cache, then the window's (llama.cpp sizes a context once to fit it, then makes it: the last two).
    sizes = [float(m) for m in re.findall(r"llama_kv_cache: size =\s+([0-9.]+) MiB", log)][-2:]
    assert len(sizes) == 2 and "creating     SWA KV cache" in log, sizes
    dims = model_dims(gemma_gguf)
    assert (dims.kv_layers, dims.swa_layers, dims.swa_window) == (18, 15, 512)
    estimate = footprint(ServerPlan("s", dims, 8192, slots=2))
    assert sum(sizes) == pytest.approx(estimate.kv_bytes / MIB, abs=0.01), (sizes, estimate)
    assert "context checkpoints enabled, max = 32" in log
