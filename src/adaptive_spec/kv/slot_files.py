"""Slot files that cross machines: which names a relay accepts, the refusal when two servers' models differ, and the
model file's sha256 both sides compare.

Rules shared by the relay service (`relay/service.py`) and its client in the proxy (`kv/relay_client.py`); pure
but for `file_sha256`, which reads the model file (blocking: call it off the event loop)."""

from __future__ import annotations

import hashlib
import re
import threading
from pathlib import Path

# One plain file name inside the slot directory: no separators, no `..`, no hidden files (the relay's own partial
# uploads are hidden, so they can never be named from outside).
_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,127}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

SHA256_HEADER = "x-adaptive-spec-sha256"  # the sha256 of the slot file a body carries (upload or download)
MODEL_HEADER = "x-adaptive-spec-model-sha256"  # the sha256 of the GGUF the sender's llama-server runs


def valid_slot_name(name: str) -> bool:
    """A plain file name llama-server and the relay may use: `[A-Za-z0-9_.-]{1,128}`, not starting with `.`."""
    # fullmatch: `$` would also match before a final newline, letting `NAME%0A` through.
    return bool(_NAME.fullmatch(name)) and ".." not in name


# adaptive-spec names every slot file it saves `as-…` (handoffs, remote prefill): a relay serves, takes and deletes
# only those, so the slot files others keep in a shared --slot-save-path (which hold their prompts' tokens) stay theirs;
# the proxy's sweep of left-overs takes only those too.
SLOT_FILE_PREFIX = "as-"


def slot_file_name(session_id: str | None, seq: int, kind: str = "") -> str:
    """`as-[kind-]<20 hex of the session's sha256>-<seq>.bin`: one name per move, nothing of the session readable."""
    tag = hashlib.sha256((session_id or "").encode()).hexdigest()[:20]
    return f"{SLOT_FILE_PREFIX}{kind + '-' if kind else ''}{tag}-{seq}.bin"


def valid_relay_name(name: str) -> bool:
    """A slot file name a relay handles: a valid one starting with `as-`."""
    return name.startswith(SLOT_FILE_PREFIX) and valid_slot_name(name)


def valid_sha256(value: str | None) -> bool:
    return value is not None and bool(_SHA256.fullmatch(value))


def model_mismatch(there: str, here: str, where: str) -> str | None:
    """Why a slot file may not move between `where` (running the GGUF of sha256 `there`) and the side that reads the
    message (`here`), or None: a KV cache is only valid for the exact same model file (weights and quantization)."""
    if there == here:
        return None
    return (
        f"the model files differ: this side runs sha256 {here}, {where} runs sha256 {there}; "
        "a KV cache moves only between servers running the same GGUF"
    )


# The sha256 of a GGUF, read once per (path, size, mtime): both sides of a KV move compare it.
_CHUNK = 4 << 20
_cache: dict[tuple[str, int, int], str] = {}
_lock = threading.Lock()


def file_sha256(path: Path) -> str:
    """Streaming (4 MiB at a time) and cached: a 16 GB model is hashed once per process, not per request.
    Blocking file I/O: call it off the event loop."""
    resolved = path.resolve()
    stat = resolved.stat()
    key = (str(resolved), stat.st_size, stat.st_mtime_ns)
    with _lock:
        known = _cache.get(key)
    if known is not None:
        return known
    digest = hashlib.sha256()
    with resolved.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    value = digest.hexdigest()
    with _lock:
        _cache[key] = value
    return value
