"""Slot files that cross machines: which names a relay accepts, the refusal when two servers' models differ, and the
model file's sha256 both sides compare.

Rules shared by the relay service (`relay/service.py`) and its client in the proxy (`kv/relay_client.py`); pure
but for `file_sha256`, which reads the model file (blocking: call it off the event loop)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
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


# The sha256 of a GGUF, read once per file (device, inode, size, mtime, ctime): both sides of a KV move compare it,
# and the head store keys heads by it. Kept in memory, and on disk where the caller names a file (the state
# folder's): a 16 GB model is read once, not at each start.
_CHUNK = 4 << 20
_cache: dict[tuple[int, int, int, int, int], str] = {}
_lock = threading.Lock()


def _identity(path: Path) -> tuple[int, int, int, int, int]:
    """Device, inode, size, mtime and ctime: a file rewritten in place with its size and mtime put back still has a
    new ctime (no one can set it)."""
    st = path.stat()
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def known_sha256(path: Path, kept: Path | None = None) -> str | None:
    """The file's sha256 when it was read before (this run, or one whose `kept` file remembers it), else None."""
    key = _identity(path.resolve())
    with _lock:
        known = _cache.get(key)
    if known is None and kept is not None:
        known = _read_kept(kept).get(":".join(map(str, key)))
        if known is not None and _SHA256.fullmatch(known):
            with _lock:
                _cache[key] = known
        else:
            known = None
    return known


def file_sha256(path: Path, kept: Path | None = None) -> str:
    """Streaming (4 MiB at a time) and cached (in memory; in `kept` too, a JSON file, when named).
    Blocking file I/O: call it off the event loop."""
    resolved = path.resolve()
    known = known_sha256(resolved, kept)
    if known is not None:
        return known
    key = _identity(resolved)
    digest = hashlib.sha256()
    with resolved.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    value = digest.hexdigest()
    if _identity(resolved) != key:  # rewritten while it was read: this digest is of no one file
        raise OSError(f"{resolved} changed while its sha256 was read")
    with _lock:
        _cache[key] = value
    if kept is not None:
        _keep(kept, ":".join(map(str, key)), value)
    return value


def _read_kept(kept: Path) -> dict[str, str]:
    try:
        raw = json.loads(kept.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in raw.items()} if isinstance(raw, dict) else {}


def _keep(kept: Path, key: str, value: str) -> None:
    entries = {**_read_kept(kept), key: value}
    if len(entries) > 256:  # models come and go: the newest are kept
        entries = dict(list(entries.items())[-256:])
    tmp = kept.with_name(f".{kept.name}.tmp")
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(entries))
        os.replace(tmp, kept)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
