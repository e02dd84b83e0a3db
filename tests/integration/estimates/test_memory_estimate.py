"""The memory estimate against llama-server's own figures: the KV cache it allocates (its `llama_kv_cache: size =`
line) equals what llama/memory/sizing.py computes from the GGUF's header, for a dense tiny model and for Gemma 3 270M's
real sliding-window weights (two cache lines: the full layers' and the window's); for the hybrid tiny `qwen35` at two
`-c`/`--parallel` settings (one drafting with its MTP head, which keeps rollback copies of the recurrent state), the
attention cache, the recurrent state's R and S parts (`llama_memory_recurrent: size =`) and the context checkpoints
each slot keeps in RAM (`created context checkpoint ... size =`)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from adaptive_spec.llama.memory.footprint import servers_to_launch
from adaptive_spec.llama.memory.gguf_info import model_dims
from adaptive_spec.llama.memory.sizing import MIB, N_CTX_CHECKPOINTS, ServerToLaunch, footprint
from adaptive_spec.llama.profiles import ModelSource, ProfileSpec, ServerSettings
from tests.support.models.tiny_drafters import SSM_CONV, SSM_GROUPS, SSM_STATE, SSM_V_HEADS, write_tiny_mtp_target
from tests.support.processes.servers import LlamaServer, http_json


def _logged_mib(log: str, what: str) -> float:
    found = re.search(rf"{what}: size =\s+([0-9.]+) MiB", log)
    assert found, f"no '{what}: size =' line in the log"
    return float(found.group(1))


def test_the_kv_estimate_equals_what_llama_server_allocates(
    llama_server_binary: str, tiny_gguf: Path, tmp_path: Path
) -> None:
    server = LlamaServer(llama_server_binary, tiny_gguf, "-c", "8192", "--parallel", "2", "-v", log_dir=tmp_path / "l")
    try:
        log = server.log_path.read_text()
    finally:
        server.stop()
    estimate = footprint(ServerToLaunch("s", model_dims(tiny_gguf), 8192, slots=2))
    assert _logged_mib(log, "llama_kv_cache") == pytest.approx(estimate.kv_bytes / MIB, abs=0.005)


# `llama_memory_recurrent: size = 0.34 MiB (8 cells, 3 layers, 8 seqs 3 rs_seq), R (f32): 0.09 MiB, S (f32): 0.25 MiB`
_RECURRENT = re.compile(
    r"llama_memory_recurrent: size =\s+([0-9.]+) MiB \(.*?(\d+) rs_seq\), R \(f32\):\s+([0-9.]+) MiB, "
    r"S \(f32\):\s+([0-9.]+) MiB"
)
# llama-server prints MiB to 2 (caches) or 3 (checkpoints) decimals: half the last digit, and a hair for the float.
HALF_CENTI, HALF_MILLI = 0.005 + 1e-9, 0.0005 + 1e-9
_CHECKPOINT = re.compile(r"created context checkpoint \d+ of (\d+) \(.*?size = ([0-9.]+) MiB\)")


@pytest.mark.parametrize(("ctx", "slots", "spec"), [(8192, 2, "none"), (16384, 8, "none"), (16384, 8, "draft-mtp")])
def test_the_hybrid_estimate_equals_llama_server_s_caches_recurrent_state_and_checkpoints(
    ctx: int, slots: int, spec: str, llama_server_binary: str, tmp_path: Path
) -> None:
    model = write_tiny_mtp_target(tmp_path / "tiny-random-qwen35-mtp.gguf")
    args = ("-c", str(ctx), "--parallel", str(slots), "--spec-type", spec, "-v")
    server = LlamaServer(llama_server_binary, model, *args, log_dir=tmp_path / "logs")
    try:
        # A first turn long enough that the slot keeps context checkpoints (byte tokens: ~900 of them).
        body = {"messages": [{"role": "user", "content": "abc def " * 110}], "max_tokens": 4, "temperature": 0}
        http_json(server.url + "/v1/chat/completions", body)
        log = server.log_path.read_text(errors="replace")  # the random model's text is not always UTF-8
    finally:
        server.stop()
    settings = ServerSettings(ModelSource(path=str(model)), ctx_size=ctx, parallel=slots)
    servers = servers_to_launch([ProfileSpec("p", (spec,))], settings)
    assert servers is not None
    (launched,) = servers
    estimate, dims = footprint(launched), launched.model
    # The target's cache, and with draft-mtp its MTP head's (a context of its own); each context is sized once to fit
    # it, then made: the last lines.
    contexts = 2 if spec == "draft-mtp" else 1
    kv = [float(m) for m in re.findall(r"llama_kv_cache: size =\s+([0-9.]+) MiB", log)][-contexts:]
    assert sum(kv) == pytest.approx(estimate.kv_bytes / MIB, abs=HALF_CENTI), (kv, estimate)
    recurrent = _RECURRENT.findall(log)
    assert recurrent, "no 'llama_memory_recurrent: size =' line in the log"
    total, rs_seq, r_mib, s_mib = (float(g) for g in recurrent[-1])
    assert rs_seq == launched.rollback_states == (3 if spec == "draft-mtp" else 0)
    assert total == pytest.approx(estimate.recurrent_bytes / MIB, abs=HALF_CENTI)
    # Its two parts from the model's own sizes: the convolution's last kernel-1 inputs, a state matrix per value head.
    value_dim = SSM_STATE * SSM_V_HEADS
    r_elems, s_elems = (SSM_CONV - 1) * (value_dim + 2 * SSM_GROUPS * SSM_STATE), SSM_STATE * value_dim
    assert dims.recurrent_state_elems == r_elems + s_elems and dims.recurrent_layers == 1
    rows_mib = slots * (1 + launched.rollback_states) * 4 / MIB  # f32, every slot and rollback copy
    assert r_mib == pytest.approx(rows_mib * r_elems, abs=HALF_CENTI)
    assert s_mib == pytest.approx(rows_mib * s_elems, abs=HALF_CENTI)
    checkpoints = _CHECKPOINT.findall(log)
    assert len(checkpoints) >= 2, "the first turn made no context checkpoints"
    for most, size in checkpoints:
        assert int(most) == N_CTX_CHECKPOINTS
        if spec == "none":  # with draft-mtp a checkpoint also holds the MTP head's KV up to it: not estimated
            assert float(size) == pytest.approx(estimate.checkpoint_bytes / slots / MIB, abs=HALF_MILLI)


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
    estimate = footprint(ServerToLaunch("s", dims, 8192, slots=2))
    assert sum(sizes) == pytest.approx(estimate.kv_bytes / MIB, abs=0.01), (sizes, estimate)
    assert "context checkpoints enabled, max = 32" in log
