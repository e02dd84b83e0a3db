"""The head store's files: the index (`index.json`, written whole and renamed into place), the head files (`<id>.head`,
mode 0600: KV encodes the prompt) each with its entry beside it (`<id>.entry`, from which a lost index is rebuilt),
their checks (size, a CRC-32 of the whole file) and the repairs a store needs after a crash, a full disk or a damaged
file.

Crash-safe: a file and its folder are synced before anything names it (the entry before the index), so a power loss
leaves either the old state or the new one; leftovers of a cut save are swept at start. No symlink is followed: a file
in the slot directory is opened with O_NOFOLLOW before it is taken. One `serve` at a time holds a store (`lock`).

Synchronous: the store runs these in a thread."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import stat
import time
import zlib
from collections.abc import Iterable
from pathlib import Path

from adaptive_spec.kv.heads.matching import HeadEntry

log = logging.getLogger(__name__)
INDEX = "index.json"
SUFFIX = ".head"
ENTRY = ".entry"
LOCK = ".lock"
_CHUNK = 8 * 1024 * 1024
_SAMPLE = 1024 * 1024


def head_path(directory: Path, head: str) -> Path:
    return directory / f"{head}{SUFFIX}"


def load_index(directory: Path) -> dict[str, HeadEntry]:
    """The index as the last run left it, repaired: entries whose file is gone or of another size (a save cut short,
    a truncated file) are dropped; a lost or unreadable index is rebuilt from the entries beside the heads, and an
    entry whose save the index never named (a run killed between them) joins it; files nothing names, symlinks and
    half-written temporaries are removed."""
    try:
        raw = json.loads((directory / INDEX).read_text())
    except FileNotFoundError:
        raw = []
    except (OSError, ValueError) as exc:
        log.warning("heads: the index in %s is unreadable (%s); rebuilt from the heads' own entries", directory, exc)
        raw = []
    found = [HeadEntry.from_json(item) for item in raw] if isinstance(raw, list) else []
    named = {entry.id for entry in found if entry is not None}
    for path in sorted(directory.glob(f"*{ENTRY}")):
        if path.stem not in named and not path.is_symlink():
            found.append(_read_entry(path))
    entries: dict[str, HeadEntry] = {}
    for entry in found:
        if entry is None:
            continue
        head = head_path(directory, entry.id)
        size = None if head.is_symlink() else file_size(head)
        if size == entry.bytes:
            entries[entry.id] = entry
        elif size is not None:
            log.warning("heads: %s holds %d bytes, not the %d saved; removed", entry.id, size, entry.bytes)
    for path in [*directory.glob(f"*{SUFFIX}"), *directory.glob(f"*{ENTRY}")]:
        if path.stem not in entries or path.is_symlink():
            unlink(path)
    for path in directory.glob(".*.tmp"):  # an index, an entry or a copied head cut short
        unlink(path)
    return entries


def _read_entry(path: Path) -> HeadEntry | None:
    try:
        return HeadEntry.from_json(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def lock(directory: Path) -> int:
    """The store's folder, held by this process (the descriptor, kept open for the run): OSError when another
    `serve` holds it, naming its pid. Two processes on one folder would delete each other's heads."""
    fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise OSError(f"{directory} is in use by another adaptive-spec serve (pid {holder})") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def sweep_slot_files(slot_dir: Path, prefix: str, older_than_s: float = 600.0) -> int:
    """Slot files a cut save or restore left under the store's prefix (none younger than `older_than_s`: another
    process's save may be under way): how many were removed."""
    removed, now = 0, time.time()
    for path in slot_dir.glob(f"{prefix}*.bin"):
        with contextlib.suppress(OSError):
            if now - path.lstat().st_mtime > older_than_s:
                path.unlink()
                removed += 1
    return removed


def write_index(directory: Path, entries: Iterable[HeadEntry]) -> None:
    """All or nothing: a full disk leaves the last index in place (OSError to the caller)."""
    _write_synced(directory, INDEX, json.dumps([e.to_json() for e in entries]))


def write_entry(directory: Path, entry: HeadEntry) -> None:
    """A head's own entry beside it, synced before the index names the head (a lost index is rebuilt from these)."""
    _write_synced(directory, f"{entry.id}{ENTRY}", json.dumps(entry.to_json()))


def _write_synced(directory: Path, name: str, data: str) -> None:
    tmp = directory / f".{name}.tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / name)
        _sync_dir(directory)
    except OSError:
        unlink(tmp)
        raise


def _sync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    fd = os.open(saved, os.O_RDONLY | os.O_NOFOLLOW)  # a symlink planted in the slot directory: ELOOP, not followed
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{saved} is not a regular file")
        os.fchmod(fd, 0o600)
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        os.replace(saved, head)
    except OSError:
        tmp = head.with_name(f".{head.name}.tmp")
        try:
            shutil.copyfile(saved, tmp)
            os.chmod(tmp, 0o600)
            with open(tmp, "rb+") as out:
                os.fsync(out.fileno())
            os.replace(tmp, head)
        finally:
            unlink(tmp)
    _sync_dir(head.parent)
    return head.stat().st_size, checksum(head)


def adopt(origin: Path, head: Path, size: int, crc: str) -> str | None:
    """Another proxy's head file taken into this store under `head`: a hard link where both share a filesystem (its
    saves replace a file, never write into it), else a private copy; None when it holds the `size` and `crc` its
    entry says, else why not (nothing is left under `head`). OSError: it cannot be read. Only a file of the head's own
    name is read: whoever can write to the shared state cannot make the proxy copy any other file it can read."""
    if origin.name != head.name:
        return f"{origin} is not named {head.name}"
    tmp = head.with_name(f".{head.name}.tmp")
    unlink(tmp)
    try:
        try:
            os.link(origin, tmp, follow_symlinks=False)
        except OSError:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out, open(os.open(origin, os.O_RDONLY | os.O_NOFOLLOW), "rb") as src:
                shutil.copyfileobj(src, out, _CHUNK)
                os.fsync(out.fileno())
        if not stat.S_ISREG(tmp.lstat().st_mode):
            return f"{origin} is not a regular file"
        if (found := file_size(tmp)) != size:
            return f"it holds {found} bytes, not the {size} saved"
        if crc and (found_crc := checksum(tmp)) != crc:
            return f"its checksum is {found_crc}, not the {crc} saved"
        os.replace(tmp, head)
        _sync_dir(head.parent)
        return None
    finally:
        unlink(tmp)


def checksum(path: Path) -> str:
    """A CRC-32 of the whole file (~25 ms for the 0.5B's 88 MB head when it is in the page cache): a flipped byte in
    the KV would otherwise be restored as if it were the prompt's."""
    crc = 0
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def file_size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
