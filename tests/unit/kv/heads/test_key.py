"""What a head's server key holds: the model known by content (its sha256, kept across runs by the file's identity),
and every launch argument not known to leave a slot's KV alone."""

from __future__ import annotations

import os
from pathlib import Path

from adaptive_spec.kv.heads.options import kv_changing_arguments, launched_heads
from adaptive_spec.kv.heads.server import key_of
from adaptive_spec.kv.heads.values import HeadsConfig
from adaptive_spec.kv.slot_files import file_sha256, known_sha256


def test_every_argument_not_known_to_leave_the_kv_alone_is_part_of_the_key(tmp_path: Path) -> None:
    args = ["-t", "1", "--lora-scaled", "a.gguf", "0.5", "--rope-freq-base=1e6", "--swa-full", "--jinja"]
    assert kv_changing_arguments(args) == ["--lora-scaled a.gguf 0.5", "--rope-freq-base=1e6", "--swa-full"]
    # One no list here knows is in the key, with its values (a negative number among them).
    assert kv_changing_arguments(["--port", "9", "--new-kv-option", "x", "-1", "-c", "8"]) == ["--new-kv-option x -1"]
    binary = tmp_path / "llama-server"
    binary.write_text("")
    config = HeadsConfig(tmp_path / "heads")
    plain = launched_heads(config, tmp_path, str(binary), ["-t", "1"])
    scaled = launched_heads(config, tmp_path, str(binary), ["--lora-scaled", "a.gguf", "0.5"])
    other = launched_heads(config, tmp_path, str(binary), ["--lora-scaled", "a.gguf", "0.7"])
    assert len({plain.build, scaled.build, other.build}) == 3
    assert plain.build == launched_heads(config, tmp_path, str(binary), ["-t", "2", "--jinja", "--metrics"]).build
    assert plain.digests == tmp_path / "heads" / ".model-sha256.json"  # beside the heads it keys


def test_a_model_replaced_at_the_same_path_size_and_time_is_another_key(tmp_path: Path) -> None:
    model, kept = tmp_path / "model.gguf", tmp_path / "digests.json"
    model.write_bytes(b"a" * 4096)
    props = {"model_path": str(model), "default_generation_settings": {"n_ctx": 4096}}
    first = key_of(props, "", ("", ""), file_sha256(model, kept))
    stat = model.stat()
    model.write_bytes(b"a" * 2048 + b"b" + b"a" * 2047)  # one byte in the middle, same size ...
    os.utime(model, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # ... and the same time
    second = key_of(props, "", ("", ""), file_sha256(model, kept))
    assert first.model_sample.startswith("sha256:") and first.hex() != second.hex()


def test_a_models_digest_is_kept_across_runs_by_the_files_identity(tmp_path: Path) -> None:
    model, kept = tmp_path / "model.gguf", tmp_path / "digests.json"
    model.write_bytes(b"m" * 1000)
    sha = file_sha256(model, kept)
    from adaptive_spec.kv import slot_files

    slot_files._cache.clear()  # a new run: nothing in memory
    assert known_sha256(model, kept) == sha  # read back from the kept file, the model not read again
    model.write_bytes(b"n" * 1000)
    assert known_sha256(model, kept) is None  # another mtime (or inode): read again when asked
