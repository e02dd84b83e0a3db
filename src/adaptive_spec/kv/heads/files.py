"""The head store's files: the index (`index.json`, written whole and renamed into place), the head files (`<id>.head`,
mode 0600: KV encodes the prompt), their checks (size, a CRC-32 of the whole file) and the repairs a store needs after a
crash, a full disk or a damaged file.

Synchronous: the store runs these in a thread."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import zlib
from collections.abc import Iterable
from pathlib import Path

from adaptive_spec.kv.heads.plan import HeadEntry

log = logging.getLogger(__name__)
INDEX = "index.json"
SUFFIX = ".head"
_CHUNK = 8 * 1024 * 1024
_SAMPLE = 1024 * 1024


def head_path(directory: Path, head: str) -> Path:
    return directory / f"{head}{SUFFIX}"


def load_index(directory: Path) -> dict[str, HeadEntry]:
    """The index as the last run left it, repaired: entries whose file is gone or of another size (a save cut short,
    a truncated file) are dropped, files no entry names (a run killed between a save and its index) and a
    half-written index are removed."""
    try:
        raw = json.loads((directory / INDEX).read_text())
    except FileNotFoundError:
        raw = []
    except (OSError, ValueError) as exc:
        log.warning("heads: the index in %s is unreadable (%s); starting empty", directory, exc)
        raw = []
    entries: dict[str, HeadEntry] = {}
    for item in raw if isinstance(raw, list) else []:
        entry = HeadEntry.from_json(item)
        if entry is None:
            continue
        size = file_size(head_path(directory, entry.id))
        if size == entry.bytes:
            entries[entry.id] = entry
        elif size is not None:
            log.warning("heads: %s holds %d bytes, not the %d saved; removed", entry.id, size, entry.bytes)
    for path in directory.glob(f"*{SUFFIX}"):
        if path.stem not in entries:
            unlink(path)
    unlink(directory / f".{INDEX}.tmp")
    return entries


def write_index(directory: Path, entries: Iterable[HeadEntry]) -> None:
    """All or nothing: a full disk leaves the last index in place (OSError to the caller)."""
    tmp = directory / f".{INDEX}.tmp"
    data = json.dumps([e.to_json() for e in entries])
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(data)
        os.replace(tmp, directory / INDEX)
    except OSError:
        unlink(tmp)
        raise


def stage(head: Path, staged: Path) -> None:
    """The head under the slot directory for llama-server to read: a hard link where both share a filesystem (a
    save that replaces the head meanwhile leaves this link on the old, whole file)."""
    unlink(staged)
    try:
        os.link(head, staged)
    except OSError:  # a copy, private from its first byte (KV encodes the prompt)
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out, head.open("rb") as src:
            shutil.copyfileobj(src, out, _CHUNK)


def take(saved: Path, head: Path) -> tuple[int, str]:
    """Move a slot file llama-server just wrote into the store, private to the user: its size and checksum (here,
    in the caller's thread). A copy (another filesystem) goes to a temporary name first, so a full disk or a kill
    leaves no half head under the head's name."""
    os.chmod(saved, 0o600)
    try:
        os.replace(saved, head)
    except OSError:
        tmp = head.with_name(f".{head.name}.tmp")
        try:
            shutil.copyfile(saved, tmp)
            os.chmod(tmp, 0o600)
            os.replace(tmp, head)
        finally:
            unlink(tmp)
    return head.stat().st_size, checksum(head)


def checksum(path: Path) -> str:
    """A CRC-32 of the whole file (~25 ms for the 0.5B's 88 MB head when it is in the page cache): a flipped byte in
    the KV would otherwise be restored as if it were the prompt's."""
    crc = 0
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def model_sample(path: str) -> str:
    """A model file's identity without reading it whole: its modification time and a digest of its first and last
    MiB (a GGUF's metadata, and its last tensors). "" when it cannot be read here (an attached server's model)."""
    try:
        st = os.stat(path)
        digest = hashlib.blake2b(f"{st.st_mtime_ns}".encode(), digest_size=12)
        with open(path, "rb") as f:
            digest.update(f.read(_SAMPLE))
            f.seek(max(0, st.st_size - _SAMPLE))
            digest.update(f.read(_SAMPLE))
    except OSError:
        return ""
    return digest.hexdigest()


def file_size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
