"""The heads on disk as the store keeps them: the index in memory, each file's checks (its size before a restore, its
checksum once a run, in the background or first for a request that wants that head: an unverified head is not
restored), the bound on bytes (least recently used first, kept as a head is added) and free disk before a save, and
the repairs (a head that fails a check is removed, with its reason logged).

The index changes on the event loop only; a snapshot of it is written in a thread, one write at a time. No HTTP: the
store (`kv/heads/store.py`) does that."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

from adaptive_spec.kv.heads.files import (
    ENTRY,
    adopt,
    checksum,
    file_size,
    head_path,
    load_index,
    lock,
    unlink,
    write_entry,
    write_index,
)
from adaptive_spec.kv.heads.matching import HeadEntry, HeadSize, evictions, head_size

log = logging.getLogger(__name__)
FREE_RESERVE_BYTES = 256 * 1024**2  # a save leaves at least this much of the disk free
_PRIOR_BYTES_PER_TOKEN = 120_000.0  # until a head is saved: above the 0.5B's 12 KiB, for larger models


class HeadBook:
    def __init__(
        self,
        directory: Path,
        max_bytes: int,
        count: Callable[[str, int], None] = lambda _name, _n: None,
        tenants: int = 1,
        gone: Callable[[list[str]], None] = lambda _heads: None,
    ) -> None:
        """`count`: where its operations are counted (the store's counts); `tenants`: how many scopes share the
        bound, each an equal share of it (1: the whole bound); `gone`: told the heads removed as damaged or deleted
        (not those the bound evicts: the other proxies keep their own bound)."""
        self.dir, self.max_bytes, self._count, self._gone = directory, max_bytes, count, gone
        self._tenants = max(1, tenants)
        self._shares: dict[str, int] = {}  # tenants whose policy names their share (bytes)
        self._scope_counts: dict[str, dict[str, int]] = {}  # the counts of each tenant's own heads (`count`)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.dir.is_symlink():
            raise OSError(f"{self.dir} is a symlink: a store is kept in a folder of its own")
        os.chmod(self.dir, 0o700)  # one made before (or by another umask) is private too: KV encodes prompts
        self._lock = lock(self.dir)  # OSError: another serve holds it (it would delete this one's heads)
        self._entries: dict[str, HeadEntry] = load_index(self.dir)  # changed here alone: the others ask (`heads`)
        self._saving: set[str] = set()  # heads whose file a save is replacing: a checksum read meanwhile proves nothing
        self._verified: set[str] = set()  # heads whose checksum this run has checked (or wrote)
        self._writing = asyncio.Lock()  # index writes one at a time, each of the index as it is when it starts

    def path(self, head: str) -> Path:
        return head_path(self.dir, head)

    def heads(self) -> list[HeadEntry]:
        """The heads kept, in the index's order (a list of its own: the index changes only here)."""
        return list(self._entries.values())

    def entry(self, head: str) -> HeadEntry | None:
        return self._entries.get(head)

    def saving(self, head: str) -> bool:
        """Whether a save is writing this head's file now (`save_started`, `save_ended`)."""
        return head in self._saving

    def save_started(self, head: str) -> None:
        self._saving.add(head)

    def save_ended(self, head: str) -> None:
        self._saving.discard(head)

    def verified(self, head: str) -> bool:
        return head in self._verified

    async def verify(self) -> None:
        """Each head's checksum, once a run, in a thread, the most recently used first (the heads a restart or a
        resumed conversation wants soonest)."""
        for entry in sorted(self._entries.values(), key=lambda e: -e.last_used_unix):
            await self.verify_one(entry)

    async def verify_one(self, entry: HeadEntry) -> bool:
        """The head's checksum, read in a thread unless this run has read it: whether the head is whole (a damaged
        one is removed). A request whose best match the background pass has not reached yet asks for it here rather
        than settle for a shorter, verified head."""
        if entry.id in self._verified:
            return True
        try:
            crc = await asyncio.to_thread(checksum, self.path(entry.id)) if entry.crc else ""
        except OSError as exc:
            crc = f"unreadable ({exc})"
        if entry.id in self._verified:
            return True  # the background pass read it meanwhile
        if self._entries.get(entry.id) != entry or entry.id in self._saving:
            return False  # replaced meanwhile by a new save, whose checksum was taken as it was written
        if crc != entry.crc:
            await self.drop(entry.id, f"its checksum is {crc}, not the {entry.crc} saved")
            return False
        self._verified.add(entry.id)
        return True

    async def check(self, entry: HeadEntry) -> bool:
        """The head's file is whole: its checksum verified this run, and its size (a damaged head is removed)."""
        if entry.id not in self._verified:
            return False
        size = await asyncio.to_thread(file_size, self.path(entry.id))
        if size != entry.bytes:
            await self.drop(entry.id, f"its file holds {size} bytes, not the {entry.bytes} saved")
            return False
        return True

    def count(self, name: str, scope: str, n: int = 1) -> None:
        """One more of `name` (saved, restored, evicted, refused, ...) in the store's counts and its tenant's."""
        self._count(name, n)
        mine = self._scope_counts.setdefault(scope, {})
        mine[name] = mine.get(name, 0) + n

    def share(self, scope: str) -> int:
        """The bytes a tenant's heads may take: its project's policy's share (`set_share`), else an equal share of the
        bound (the whole bound without tenants); never more than the bound."""
        return min(self.max_bytes, self._shares.get(scope) or self.max_bytes // self._tenants)

    def set_share(self, scope: str, share_bytes: int) -> None:
        """A tenant's share as its project's policy says (0: an equal one); learned as its requests are served."""
        if share_bytes > 0:
            self._shares[scope] = share_bytes
        else:
            self._shares.pop(scope, None)

    async def room(self, prompt_tokens: int, scope: str = "", key: str = "") -> bool:
        """Free disk for a head of this size (sized by the heads of its server `key`), and its tenant's share big
        enough to hold it (the bound is kept as the head is added: a save may still be skipped)."""
        incoming = self.head_size(key).bytes_for(prompt_tokens)
        if incoming > self.share(scope) and self._entries:  # measured, not the prior's guess: too big for its share
            self.count("refused", scope)
            log.info("heads: a head of ~%d MB is larger than its tenant's share; not saved", incoming // 1_000_000)
            return False
        free = await asyncio.to_thread(lambda: shutil.disk_usage(self.dir).free)
        if free < FREE_RESERVE_BYTES + incoming * 2:
            self.count("refused", scope)
            log.warning("heads: %d MB free in the heads directory; the head is not saved", free // 1_000_000)
            return False
        return True

    async def add(self, entry: HeadEntry) -> None:
        """The new head in the index, the bound kept; a full disk loses the new head, not the index (OSError). Its
        own entry is written (and synced) beside it first: an index lost after this still finds it."""
        if entry.bytes > self.share(entry.scope):  # written, and larger than its tenant's share: not kept
            self.count("refused", entry.scope)
            log.info("heads: a head of %d MB is larger than its tenant's share; removed", entry.bytes // 1_000_000)
            await asyncio.to_thread(unlink, self.path(entry.id))
            return
        await asyncio.to_thread(write_entry, self.dir, entry)
        self._entries[entry.id] = entry
        self._verified.add(entry.id)
        # Its tenant's own least recently used go first (one tenant cannot push another's heads out), then the bound.
        mine = [e for e in self._entries.values() if e.scope == entry.scope]
        evicted = evictions(mine, self.share(entry.scope))
        evicted += evictions([e for e in self._entries.values() if e.id not in evicted], self.max_bytes)
        for head in evicted:
            if head != entry.id:
                self.count("evicted", self._entries[head].scope)
        await self.forget(evicted)
        try:
            await self._write_index()
        except OSError:
            await self.forget([entry.id])
            raise

    async def adopt(self, entry: HeadEntry, origin: Path) -> bool:
        """Another proxy's head (its entry, its file at `origin`) kept here too, once its size and checksum hold;
        whether it was (OSError: its file cannot be read)."""
        if entry.id in self._entries or entry.id in self._saving:
            return False
        self._saving.add(entry.id)
        try:
            why = await asyncio.to_thread(adopt, origin, self.path(entry.id), entry.bytes, entry.crc)
        finally:
            self._saving.discard(entry.id)
        if why is not None:
            log.warning("heads: another proxy's head %s is not taken: %s", entry.id, why)
            return False
        await self.add(replace(entry, restores=0))
        return entry.id in self._entries

    async def used(self, entry: HeadEntry) -> None:
        current = self._entries.get(entry.id)
        if current is None:
            return  # deleted while it was restored: not brought back
        self._entries[entry.id] = replace(current, last_used_unix=time.time(), restores=current.restores + 1)
        await self.write_index_logged()

    async def drop(self, head: str, why: str) -> None:
        """A head that cannot be restored, removed (the store repairs itself), with the reason logged."""
        if await self.forget([head]):
            self._count("removed", 1)
            log.warning("heads: %s removed: %s", head, why)
            self._gone([head])
            await self.write_index_logged()

    async def forget(self, heads: Iterable[str]) -> int:
        """Out of the index (here, on the loop), their files removed in a thread: how many were in the index."""
        gone = [head for head in heads if self._entries.pop(head, None) is not None]
        self._verified.difference_update(gone)
        if gone:
            paths = [p for head in gone for p in (self.path(head), self.dir / f"{head}{ENTRY}")]
            await asyncio.to_thread(_unlink_all, paths)
        return len(gone)

    def close(self) -> None:
        """The folder's lock let go (the process's end does it too)."""
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1

    async def delete(self, heads: Iterable[str], tell: bool = True) -> int:
        """Remove these heads: how many were removed (`tell`: told as gone, unless another proxy told it)."""
        kept = [h for h in heads if h in self._entries]
        removed = await self.forget(kept)
        if removed:
            if tell:
                self._gone(kept)
            await self.write_index_logged()
        return removed

    async def write_index_logged(self) -> None:
        try:
            await self._write_index()
        except OSError as exc:  # the files stay; the next start drops what the index does not name
            log.warning("heads: the index was not written: %s", exc)

    def head_size(self, key: str = "") -> HeadSize:
        """A new head's bytes as the saved heads measure them (a fixed part and one per token: `head_size`): those of
        the same server key (one model and its settings: a hybrid's fixed state is not a dense model's) where there
        are any, else all of them."""
        same = [e for e in self._entries.values() if key and e.key == key]
        return head_size(same or self._entries.values(), _PRIOR_BYTES_PER_TOKEN)

    def describe(self, scope: str | None = None) -> dict[str, Any]:
        """The heads of `scope` (None: all); no path of this machine."""
        heads = sorted(
            (e for e in self._entries.values() if scope is None or e.scope == scope), key=lambda e: -e.last_used_unix
        )
        out = {
            "max_bytes": self.max_bytes,
            "bytes": sum(e.bytes for e in heads),
            "heads": [e.describe() for e in heads],
        }
        if scope is not None:  # a tenant's own view: its own heads' counts
            names = ("saved", "session_saved", "restored", "evicted", "refused")
            out["counts"] = {name: self._scope_counts.get(scope, {}).get(name, 0) for name in names}
        return out

    async def _write_index(self) -> None:
        async with self._writing:
            snapshot = list(self._entries.values())  # taken on the loop: the thread never reads the live dict
            await asyncio.to_thread(write_index, self.dir, snapshot)


def _unlink_all(paths: Iterable[Path]) -> None:
    for path in paths:
        unlink(path)
