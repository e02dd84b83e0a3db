"""A GGUF's metadata header, read without loading its tensors: the dimensions `llama/memory/sizing.py` sizes a cache
from."""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any, BinaryIO

from adaptive_spec.errors import ModelError
from adaptive_spec.llama.memory.sizing import ModelDims

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_KEYS = 1 << 16


def _read(fh: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = fh.read(size)
    if len(data) != size:
        raise ValueError("the file ends inside its metadata")
    return struct.unpack(fmt, data)[0]


def _string(fh: BinaryIO, keep: bool) -> str | None:
    n = _read(fh, "<Q")
    if not keep:
        fh.seek(n, os.SEEK_CUR)
        return None
    return fh.read(n).decode("utf-8", "replace")


def _value(fh: BinaryIO, kind: int, keep: bool) -> Any:
    if kind in _SCALARS:
        return _read(fh, _SCALARS[kind])
    if kind == _STRING:
        return _string(fh, keep)
    if kind == _ARRAY:
        item, count = _read(fh, "<I"), _read(fh, "<Q")
        if item in _SCALARS and not keep:  # a vocabulary's scores: skipped, not read
            fh.seek(struct.calcsize(_SCALARS[item]) * count, os.SEEK_CUR)
            return None
        values = [_value(fh, item, keep) for _ in range(count)]
        return values if keep else None
    raise ValueError(f"unknown metadata value type {kind}")


def read_metadata(path: Path) -> dict[str, Any]:
    """The header's key/value pairs, except the tokenizer's (large, and not needed here)."""
    with path.open("rb") as fh:
        if fh.read(4) != b"GGUF":
            raise ValueError("not a GGUF file")
        version = _read(fh, "<I")
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old")
        _read(fh, "<Q")  # tensor count
        n_keys = _read(fh, "<Q")
        if n_keys > _MAX_KEYS:
            raise ValueError(f"{n_keys} metadata keys")
        meta: dict[str, Any] = {}
        for _ in range(n_keys):
            key = _string(fh, True) or ""
            kind = _read(fh, "<I")
            keep = not key.startswith("tokenizer.")
            value = _value(fh, kind, keep)
            if keep:
                meta[key] = value
        return meta


def _first(value: Any) -> int:
    """A per-layer array's first value (llama.cpp allows head counts per layer), or the scalar."""
    if isinstance(value, list):
        return int(value[0]) if value else 0
    return int(value or 0)


# The sliding-window pattern llama.cpp gives an architecture whose GGUF names none (its load_arch_hparams): every n-th
# layer attends to the whole context, the others to the window. An architecture not listed here is counted as full
# attention (its KV cache overestimated, never under).
_SWA_PATTERNS = {"gemma2": 2, "gemma3": 6, "gemma3n": 5, "cohere2": 4}


def _sliding_window(meta: dict[str, Any], arch: str, layers: int) -> tuple[int, int]:
    """(layers with a sliding window, the window in tokens) as llama.cpp's `set_swa_pattern` lays them out."""
    window = int(meta.get(f"{arch}.attention.sliding_window", 0) or 0)
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", _SWA_PATTERNS.get(arch))
    if window <= 0 or pattern is None:
        return 0, 0
    if isinstance(pattern, list):  # one flag per layer
        return sum(1 for flag in pattern[:layers] if flag), window
    n = int(pattern)
    return sum(1 for il in range(layers) if n == 0 or il % n < n - 1), window


def model_dims(path: Path) -> ModelDims:
    """A model's cache dimensions from its GGUF; raises ModelError naming the file when they cannot be read."""
    try:
        meta = read_metadata(path)
        arch = str(meta["general.architecture"])
        layers = int(meta[f"{arch}.block_count"])
        heads = _first(meta.get(f"{arch}.attention.head_count", 0))
        kv_heads = _first(meta.get(f"{arch}.attention.head_count_kv", heads))
        embd = int(meta.get(f"{arch}.embedding_length", 0))
        head_dim = embd // heads if heads else 0
        key_length = int(meta.get(f"{arch}.attention.key_length", head_dim))
        value_length = int(meta.get(f"{arch}.attention.value_length", head_dim))
        interval = int(meta.get(f"{arch}.full_attention_interval", 0))
        # Next-token (MTP) layers after the trunk: no cache in the target's context (the MTP head's draft context has
        # one of its own).
        nextn = int(meta.get(f"{arch}.nextn_predict_layers", 0))
        recurrent_layers = 0
        state = 0
        if interval > 0:  # a hybrid (qwen35 and kin): every interval-th layer has attention, the others a state
            kv_layers = (layers - nextn) // interval
            recurrent_layers = layers - nextn - kv_layers
            inner = int(meta.get(f"{arch}.ssm.inner_size", 0))
            d_state = int(meta.get(f"{arch}.ssm.state_size", 0))
            groups = int(meta.get(f"{arch}.ssm.group_count", 0))
            kernel = int(meta.get(f"{arch}.ssm.conv_kernel", 0))
            # The convolution's last kernel-1 inputs (q, k and v: llama.cpp's n_embd_r) and the delta-net state, a
            # d_state-square matrix per value head (n_embd_s = d_state × d_inner), f32, as llama.cpp allocates them.
            state = max(0, kernel - 1) * (inner + 2 * groups * d_state) + inner * d_state
        else:
            kv_layers = layers
        swa_layers, window = _sliding_window(meta, arch, kv_layers)
        return ModelDims(
            name=path.name,
            file_bytes=path.stat().st_size,
            kv_layers=kv_layers,
            kv_heads=kv_heads,
            key_length=key_length,
            value_length=value_length,
            recurrent_layers=max(0, recurrent_layers),
            recurrent_state_elems=state,
            max_context=int(meta.get(f"{arch}.context_length", 0)),
            swa_layers=swa_layers,
            swa_window=window,
            nextn_layers=nextn,
        )
    except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
        raise ModelError(f"{path}: cannot read its dimensions from the GGUF header ({exc})") from exc
