"""llama/memory/sizing.py: a setup's memory from the GGUF's dimensions, and the verdict against a device report."""

from __future__ import annotations

from pathlib import Path

import pytest

from adaptive_spec.errors import ModelError
from adaptive_spec.llama.memory.gguf_info import model_dims
from adaptive_spec.llama.memory.sizing import (
    MIB,
    DeviceReport,
    ModelDims,
    ServerToLaunch,
    describe,
    footprint,
    largest_context,
    verdict,
)

# Qwen2.5-Coder-0.5B's own header: 24 layers, 2 KV heads of 64.
QWEN_05B = ModelDims("q05", 491_400_064, kv_layers=24, kv_heads=2, key_length=64, value_length=64)


def test_kv_per_token_from_the_dimensions_and_the_cache_type() -> None:
    assert QWEN_05B.kv_bytes_per_token() == 24 * 2 * (64 + 64) * 2 == 12_288
    assert QWEN_05B.kv_bytes_per_token("q8_0") == 24 * 2 * 128 * 34 / 32
    # llama-server says "llama_kv_cache: size = 384.00 MiB (32768 cells, 24 layers)" for this model at -c 32768.
    assert footprint(ServerToLaunch("s", QWEN_05B, 32768)).kv_bytes == 384 * MIB


def test_slots_share_the_context_and_each_has_its_own_recurrent_state() -> None:
    hybrid = ModelDims("h", 1000, 1, 4, 16, 16, recurrent_layers=2, recurrent_state_elems=100)
    one, four = footprint(ServerToLaunch("a", hybrid, 4096)), footprint(ServerToLaunch("b", hybrid, 4096, slots=4))
    assert one.kv_bytes == four.kv_bytes
    assert four.recurrent_bytes == 4 * one.recurrent_bytes == 4 * 2 * 100 * 4


def test_a_drafter_adds_its_file_and_a_cache_of_its_own() -> None:
    drafter = ModelDims("d", 100 * MIB, 1, 4, 16, 16)
    f = footprint(ServerToLaunch("s", QWEN_05B, 1024, drafter=drafter))
    assert f.drafter_bytes == 100 * MIB
    assert f.kv_bytes == (12_288 + 256) * 1024


def test_the_verdict_says_what_would_fit() -> None:
    server = ModelDims("m", 10_000 * MIB, 16, 4, 256, 256)  # 64 KiB a token
    servers = [ServerToLaunch("oneshot", server, 131_072), ServerToLaunch("iterative", server, 131_072)]
    device = DeviceReport("GPU 0", 32 * 1024 * MIB, 32 * 1024 * MIB)
    one = verdict(servers[:1], device)
    assert one.fits and "fits GPU 0" in one.text
    two = verdict(servers, device)
    assert not two.fits
    assert "offload fewer layers" in two.text and "one server for every profile" in two.text
    ctx = largest_context(servers, device.free_bytes, 1024 * MIB)
    assert ctx == (32 * 1024 - 1024 - 20_000) * MIB // (2 * 65_536) == 93_952
    assert f"-c {ctx // 256 * 256}" in two.text
    tiny = DeviceReport("small", 8 * 1024 * MIB, 8 * 1024 * MIB)
    assert "would fit" not in verdict(servers, tiny).text


def test_describe_names_each_server_and_says_when_a_cpu_shares_the_file() -> None:
    lines = describe([ServerToLaunch("oneshot", QWEN_05B, 32768), ServerToLaunch("iterative", QWEN_05B, 32768)], True)
    assert lines[0] == "  oneshot: model 469 MiB, KV 384 MiB (32768 tokens × 12.0 KiB, f16) = 853 MiB"
    assert lines[-1].startswith("  total for 2 servers: 1,705 MiB (on this CPU")
    assert describe([ServerToLaunch("s", QWEN_05B, 32768, slots=4)], False)[0].count("4 slots of 8192") == 1


def test_the_header_reader_reads_the_shipped_tiny_models(tiny_gguf: Path) -> None:
    dims = model_dims(tiny_gguf)
    assert (dims.kv_layers, dims.kv_heads, dims.key_length, dims.value_length) == (2, 4, 16, 16)
    assert dims.file_bytes == tiny_gguf.stat().st_size and dims.max_context == 32768


def test_a_file_that_is_not_a_gguf_is_a_model_error_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00")  # ends inside its header
    with pytest.raises(ModelError, match=r"x\.gguf"):
        model_dims(bad)
    (tmp_path / "y.gguf").write_text("hello")
    with pytest.raises(ModelError, match="not a GGUF"):
        model_dims(tmp_path / "y.gguf")


def test_the_device_report_comes_from_the_user_or_nvidia_smi_or_nowhere() -> None:
    from adaptive_spec.llama.memory.footprint import device_report

    stated = device_report(24576, query=lambda: "ignored")
    assert stated is not None and stated.total_bytes == 24576 * MIB
    gpu = device_report(None, query=lambda: "NVIDIA RTX PRO 6000, 97887, 96512")
    assert gpu == DeviceReport("NVIDIA RTX PRO 6000", 97887 * MIB, 96512 * MIB)
    assert device_report(None, query=lambda: None) is None
    assert device_report(None, query=lambda: "garbled") is None


def test_launch_lines_size_each_server_from_its_files(tiny_gguf: Path) -> None:
    from adaptive_spec.llama.memory.footprint import launch_lines
    from adaptive_spec.llama.profiles import ModelSource, ProfileSpec, ServerSettings

    settings = ServerSettings(ModelSource(path=str(tiny_gguf)), ctx_size=4096, extra_args=("-ctk", "q8_0"))
    specs = [ProfileSpec("oneshot", ("none",)), ProfileSpec("iterative", ("ngram-mod",))]
    lines = launch_lines(specs, settings, None, "planned: one llama-server per profile")
    assert lines[0].startswith("memory (planned: one llama-server per profile;")
    assert "q8_0" in lines[1] and lines[-1].startswith("  total for 2 servers")
    small = DeviceReport("GPU", 2 * MIB, 2 * MIB)
    assert "does not fit GPU" in launch_lines(specs, settings, small, "x")[-1]
    remote = ServerSettings(ModelSource(hf_repo="org/repo:Q4_K_M"))
    assert launch_lines(specs, remote, None, "x") == ["memory: not estimated (the model is not a local GGUF here)"]


def test_a_sliding_window_s_layers_hold_the_window_and_a_batch_per_slot_not_the_context() -> None:
    # Gemma 3 270M's shape: 18 layers, 15 of them with a 512-token window, one KV head of 256 + 256 (1 KiB a token a
    # layer in f16). llama-server b11549 at -c 8192 --parallel 2 logged 24.00 MiB for the 3 full layers (4,096
    # cells a slot) and 30.00 MiB for the 15 windowed ones (1,024 cells a slot: 512 + 512 padded to 256).
    gemma = ModelDims("g", 253_113_024, 18, 1, 256, 256, swa_layers=15, swa_window=512)
    f = footprint(ServerToLaunch("s", gemma, 8192, slots=2))
    assert f.kv_bytes == (24 + 30) * MIB
    assert f.kv_bytes_per_token == 3 * 1024  # only the full layers grow with the context
    assert gemma.swa_cells(8192, 2) == 2048 and gemma.swa_cells(600, 1) == 768  # the slot's context at most
    assert f.checkpoint_bytes == 2 * 15 * MIB  # a checkpoint of each slot: its windowed layers' cache
    line = describe([ServerToLaunch("s", gemma, 8192, slots=2)], shared_file_pages=True)[0]
    assert "KV 54 MiB (8192 tokens × 3.0 KiB + 512-token windows 30 MiB, f16, 2 slots of 4096)" in line, line
    assert "context checkpoints up to 32 × 30 MiB = 960 MiB in RAM" in line, line


def test_a_dense_model_makes_no_checkpoints() -> None:
    dense = ModelDims("d", 1000, 24, 2, 64, 64)
    assert footprint(ServerToLaunch("a", dense, 4096)).checkpoint_bytes == 0
    assert "checkpoints" not in describe([ServerToLaunch("a", dense, 4096)], shared_file_pages=True)[0]


def test_rollback_copies_multiply_a_slot_s_recurrent_state_not_a_drafter_s() -> None:
    hybrid = ModelDims("h", 1000, 1, 4, 16, 16, recurrent_layers=2, recurrent_state_elems=100)
    drafter = ModelDims("d", 10, 1, 4, 16, 16, recurrent_layers=1, recurrent_state_elems=10)
    plain = footprint(ServerToLaunch("a", hybrid, 4096, slots=2))
    drafting = footprint(ServerToLaunch("b", hybrid, 4096, slots=2, drafter=drafter, rollback_states=15))
    assert drafting.recurrent_bytes == 16 * plain.recurrent_bytes + 2 * 10 * 4
    assert (
        "recurrent state 0 MiB with 15 rollback copies a slot"
        in describe([ServerToLaunch("b", hybrid, 4096, slots=2, rollback_states=15)], shared_file_pages=True)[0]
    )
