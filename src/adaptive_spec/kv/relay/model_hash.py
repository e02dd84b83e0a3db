"""The sha256 of a GGUF, read once per (path, size, mtime): both sides of a KV move compare it."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

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
