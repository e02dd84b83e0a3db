"""What a head's server key holds beyond the model file: the launch arguments that change a slot's KV, and, for an
attached server whose model file cannot be read here, what the server says of the weights it loaded."""

from __future__ import annotations

from pathlib import Path

from adaptive_spec.kv.heads.options import kv_changing_arguments, launched_heads
from adaptive_spec.kv.heads.server import key_of, served_weights
from adaptive_spec.kv.heads.values import HeadsConfig


def test_adapters_control_vectors_and_rope_overrides_are_part_of_the_key(tmp_path: Path) -> None:
    args = ["-t", "1", "--lora-scaled", "a.gguf", "0.5", "--rope-freq-base=1e6", "--swa-full", "--jinja"]
    assert kv_changing_arguments(args) == ["--lora-scaled a.gguf 0.5", "--rope-freq-base=1e6", "--swa-full"]
    binary = tmp_path / "llama-server"
    binary.write_text("")
    config = HeadsConfig(tmp_path / "heads")
    plain = launched_heads(config, tmp_path, str(binary), ["-t", "1"])
    scaled = launched_heads(config, tmp_path, str(binary), ["--lora-scaled", "a.gguf", "0.5"])
    other = launched_heads(config, tmp_path, str(binary), ["--lora-scaled", "a.gguf", "0.7"])
    assert len({plain.build, scaled.build, other.build}) == 3
    assert plain.build == launched_heads(config, tmp_path, str(binary), ["-t", "2", "--jinja"]).build


def test_an_attached_server_s_unreadable_model_is_known_by_the_weights_it_says_it_loaded() -> None:
    props = {"model_path": "/elsewhere/model.gguf", "default_generation_settings": {"n_ctx": 4096}}
    key = key_of(props, "", ("", ""))
    assert key.model_bytes == 0 and key.model_sample == ""  # the file is not readable here
    meta = {"n_params": 494032768, "size": 491400064, "n_vocab": 151936, "n_embd": 896, "n_ctx_train": 32768}
    first = served_weights({"data": [{"id": "m", "meta": {**meta, "vocab_type": 2}}]})
    replaced = served_weights({"data": [{"id": "m", "meta": {**meta, "n_params": 1543714304, "vocab_type": 2}}]})
    assert first.startswith("served:") and first != replaced
    assert served_weights({"data": []}) == served_weights(None) == "unknown"
