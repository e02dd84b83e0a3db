"""The heads on disk as the store keeps them: the index in memory, each file's checks before a restore, the bound on
bytes (least recently used first) and free disk before a save, and the repairs (a head that fails a check or that
llama-server refuses is removed, with its reason logged). No HTTP: the store (`kv/heads/store.py`) does that."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from adaptive_spec.kv.heads.files import checksum, file_size, head_path, load_index, unlink, write_index
from adaptive_spec.kv.heads.plan import HeadEntry, evictions

log = logging.getLogger(__name__)
FREE_RESERVE_BYTES = 256 * 1024**2  # a save leaves at least this much of the disk free
_PRIOR_BYTES_PER_TOKEN = 120_000.0  # until a head is saved: above the 0.5B's 12 KiB, for larger models


class HeadBook:
    def __init__(self, directory: Path, max_bytes: int, counts: dict[str, int]) -> None:
        self.dir, self.max_bytes, self.counts = directory, max_bytes, counts
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.entries: dict[str, HeadEntry] = load_index(self.dir)
        self._verified: set[str] = set()  # heads whose checksum this run has checked (or wrote)

    def path(self, head: str) -> Path:
        return head_path(self.dir, head)

    async def check(self, entry: HeadEntry) -> bool:
        """The head's file is whole: its size, and once a run its checksum (a damaged head is removed)."""
        size = await asyncio.to_thread(file_size, self.path(entry.id))
        if size != entry.bytes:
            self.drop(entry.id, f"its file holds {size} bytes, not the {entry.bytes} saved")
            return False
        if entry.crc and entry.id not in self._verified:
            crc = await asyncio.to_thread(checksum, self.path(entry.id))
            if crc != entry.crc:
                self.drop(entry.id, f"its checksum is {crc}, not the {entry.crc} saved")
                return False
            self._verified.add(entry.id)
        return True

    async def room(self, prompt_tokens: int) -> bool:
        """Free disk for a head of this size, and the bound kept while it is written (older heads go first)."""
        incoming = int(self.bytes_per_token() * prompt_tokens)
        free = await asyncio.to_thread(lambda: shutil.disk_usage(self.dir).free)
        if free < FREE_RESERVE_BYTES + incoming * 2:
            self.counts["refused"] += 1
            log.warning("heads: %d MB free in %s; the head is not saved", free // 1_000_000, self.dir)
            return False
        self._evict(min(incoming, self.max_bytes))
        return True

    def add(self, entry: HeadEntry) -> None:
        """The new head in the index, the bound kept; a full disk loses the new head, not the index (OSError)."""
        self.entries[entry.id] = entry
        self._verified.add(entry.id)
        self._evict(0)
        try:
            write_index(self.dir, self.entries.values())
        except OSError:
            self.remove(entry.id)
            raise

    def used(self, entry: HeadEntry) -> None:
        self.entries[entry.id] = replace(entry, last_used_unix=time.time(), restores=entry.restores + 1)
        self.write_index_logged()

    def drop(self, head: str, why: str) -> None:
        """A head that cannot be restored, removed (the store repairs itself), with the reason logged."""
        if self.remove(head):
            self.counts["removed"] += 1
            log.warning("heads: %s removed: %s", head, why)
            self.write_index_logged()

    def remove(self, head: str) -> bool:
        self._verified.discard(head)
        if self.entries.pop(head, None) is None:
            return False
        unlink(self.path(head))
        return True

    def delete(self, head: str | None) -> int:
        """Remove one head (or all, `None`): how many were removed."""
        ids = [head] if head is not None else list(self.entries)
        removed = sum(1 for i in ids if self.remove(i))
        if removed:
            self.write_index_logged()
        return removed

    def write_index_logged(self) -> None:
        try:
            write_index(self.dir, self.entries.values())
        except OSError as exc:  # the files stay; the next start drops what the index does not name
            log.warning("heads: the index in %s was not written: %s", self.dir, exc)

    def bytes_per_token(self) -> float:
        saved = sum(e.saved_tokens for e in self.entries.values())
        return sum(e.bytes for e in self.entries.values()) / saved if saved else _PRIOR_BYTES_PER_TOKEN

    def describe(self) -> dict[str, Any]:
        heads = sorted(self.entries.values(), key=lambda e: -e.last_used_unix)
        return {
            "directory": str(self.dir),
            "max_bytes": self.max_bytes,
            "bytes": sum(e.bytes for e in heads),
            "heads": [e.describe() for e in heads],
        }

    def _evict(self, incoming_bytes: int) -> None:
        for old in evictions(self.entries.values(), self.max_bytes, incoming_bytes):
            self.remove(old)
            self.counts["evicted"] += 1
