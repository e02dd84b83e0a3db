"""The head store's shell: head files (`<id>.head`, mode 0600) and their index (`index.json`) in a directory of the
state directory, saved from an idle llama-server's slot after a session's first turn and restored into a new
session's slot before its first turn is forwarded. Every failure here is logged and ends in an ordinary request
(a re-prefill): nothing raises into the request path. llama-server only reads and writes `--slot-save-path`, so a
head is linked (or copied) there as `head-<id>.bin` only for the restore, and moved out of it after the save: the
sweeps of `as-*` files never see a head."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp

from adaptive_spec.common.lru import LRU
from adaptive_spec.kv.heads.plan import (
    DEFAULT_MAX_BYTES,
    MIN_HEAD_TOKENS,
    RESTORE_PRIOR_BYTES_PER_S,
    HeadEntry,
    Match,
    ServerKey,
    best_match,
    chain,
    covered,
    evictions,
    head_id,
    inert,
    price,
    template_digest,
)
from adaptive_spec.kv.slots import SlotError, slot_action
from adaptive_spec.servers.upstreams import Upstream

log = logging.getLogger(__name__)
INDEX = "index.json"
SUFFIX = ".head"
_SLOT_PREFIX = "head-"  # the name a head has in the slot directory while it is restored or saved
_FREE_RESERVE_BYTES = 256 * 1024**2  # a save leaves at least this much of the disk free
_IDLE_WAIT_S = 20.0  # a save waits this long for the server to go idle, else it is skipped
_ACTION_TIMEOUT = aiohttp.ClientTimeout(total=60)
_FAILURES = (SlotError, OSError, aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError)


@dataclass(frozen=True, slots=True)
class HeadsConfig:
    directory: Path | None  # None: heads/ in the state directory (resolved where `serve` starts)
    max_bytes: int = DEFAULT_MAX_BYTES


@dataclass(frozen=True, slots=True)
class Restored:
    """A head restored for one request: checked against that request's `cache_n` when it ends."""

    head: str
    server: str
    tokens: int
    restore_ms: float

    def reason(self) -> str:
        return f"warm: head of {self.tokens} tokens restored in {self.restore_ms:.0f} ms"


class HeadStore:
    def __init__(self, config: HeadsConfig, slot_dir: Path, client: Callable[[], aiohttp.ClientSession]) -> None:
        if config.directory is None:
            raise ValueError("HeadsConfig.directory: resolve the state directory's heads/ first")
        self.dir, self.max_bytes, self.slot_dir, self._client = config.directory, config.max_bytes, slot_dir, client
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._entries: dict[str, HeadEntry] = self._load()
        self._keys: dict[str, ServerKey] = {}
        self._inert: set[str] = set()  # servers where a restore was reported and reused nothing
        self._seen: LRU[str, bool] = LRU(100_000)  # sessions whose first request the store has seen
        # First requests under way, and the head restored for each (bounded: one that raised never ends).
        self._firsts: LRU[str, Restored | None] = LRU(4096)
        self._restore_s_per_byte: float | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._lock = asyncio.Lock()  # one save or restore at a time: each pauses the server's slots
        self.counts = {"saved": 0, "restored": 0, "refused": 0, "failed": 0, "inert": 0, "evicted": 0}

    # -- the request path -----------------------------------------------------------------------------------------

    def first_request(self, session_id: str | None) -> bool:
        """Whether this is the first request of its session the store sees (only those save or restore heads)."""
        if session_id is None or self._seen.get(session_id) is not None:
            return False
        self._seen.put(session_id, True)
        return True

    def begin(self, request_id: str, restored: Restored | None) -> None:
        self._firsts.put(request_id, restored)

    def end(self, request_id: str) -> tuple[bool, Restored | None]:
        """Whether this request was a first one the store saw (and what was restored for it)."""
        if request_id not in self._firsts:
            return False, None
        return True, self._firsts.pop(request_id)

    async def restore(
        self,
        upstream: Upstream,
        slot: int | None,
        pieces: Sequence[bytes],
        slot_tokens: int,
        prefill_s_per_token: float,
    ) -> Restored | None:
        """Restore the stored head sharing most with this prompt into `slot` when it pays; None otherwise."""
        try:
            return await self._restore(upstream, slot, pieces, slot_tokens, prefill_s_per_token)
        except _FAILURES as exc:
            self.counts["failed"] += 1
            log.warning("heads: restore on %s failed (the request prefills): %s", upstream.label, exc)
            return None

    def served(
        self,
        upstream: Upstream,
        slot: int | None,
        pieces: Sequence[bytes],
        chars: Sequence[int],
        cache_n: int,
        prompt_tokens: int,
        restored: Restored | None,
        agent: str | None,
        project: str | None,
    ) -> None:
        """A session's first request was served: learn an inert restore, else save its head in the background."""
        if restored is not None and inert(restored.tokens, cache_n):
            self._inert.add(upstream.base_url)
            self.counts["inert"] += 1
            log.warning(
                "heads: %s restored a head of %d tokens but the prompt reused %d: no more restores there",
                upstream.label,
                restored.tokens,
                cache_n,
            )
        if prompt_tokens < MIN_HEAD_TOKENS or upstream.upstream_model is not None:
            return
        task = asyncio.get_running_loop().create_task(
            self._save_logged(upstream, slot or 0, tuple(pieces), tuple(chars), prompt_tokens, agent, project)
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def settled(self) -> None:
        """Wait for the saves under way (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # -- what /adaptive/heads shows and deletes -------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        heads = sorted(self._entries.values(), key=lambda e: -e.last_used_unix)
        return {
            "directory": str(self.dir),
            "max_bytes": self.max_bytes,
            "bytes": sum(e.bytes for e in heads),
            "counts": dict(self.counts),
            "inert_servers": sorted(self._inert),
            "heads": [e.describe() for e in heads],
        }

    def delete(self, head: str | None) -> int:
        """Remove one head (or all, `None`): how many were removed."""
        ids = [head] if head is not None else list(self._entries)
        removed = sum(1 for i in ids if self._remove(i))
        if removed:
            self._write_index()
        return removed

    # -- inside ---------------------------------------------------------------------------------------------------

    async def _restore(
        self,
        upstream: Upstream,
        slot: int | None,
        pieces: Sequence[bytes],
        slot_tokens: int,
        prefill_s_per_token: float,
    ) -> Restored | None:
        if upstream.upstream_model is not None or upstream.base_url in self._inert or not self._entries:
            return None
        key = await self._key(upstream)
        match = best_match(chain(key, pieces), self._entries.values())
        if match is None:
            return None
        cost = price(match, slot_tokens, prefill_s_per_token, self._restore_bytes_per_s())
        if not cost.pays:
            log.info(
                "heads: not restoring %s on %s: %d tokens more than the slot holds, restore %.2f s vs prefill %.2f s",
                match.entry.id,
                upstream.label,
                cost.gain_tokens,
                cost.restore_s,
                cost.prefill_s,
            )
            return None
        async with self._lock:
            n_slots = await self._idle(upstream, wait_s=0.0)
            if n_slots is None or (slot is None and n_slots != 1):
                return None  # busy, or several slots and none named: the request may land in another one
            return await self._restore_file(upstream, slot or 0, match)

    async def _restore_file(self, upstream: Upstream, slot: int, match: Match) -> Restored:
        entry = match.entry
        name = f"{_SLOT_PREFIX}{entry.id}.bin"
        staged = self.slot_dir / name
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(_stage, self.dir / f"{entry.id}{SUFFIX}", staged)
            answer = await slot_action(self._client(), upstream, slot, "restore", name, _ACTION_TIMEOUT)
        finally:
            await asyncio.to_thread(_unlink, staged)
        elapsed = time.perf_counter() - t0
        n_restored = int(answer.get("n_restored") or -1)
        if n_restored != entry.saved_tokens:
            raise SlotError(f"restored {n_restored} of the head's {entry.saved_tokens} tokens")
        self._observe_restore(entry.bytes, elapsed)
        self._entries[entry.id] = replace(entry, last_used_unix=time.time(), restores=entry.restores + 1)
        await asyncio.to_thread(self._write_index)
        self.counts["restored"] += 1
        restored = Restored(entry.id, upstream.base_url, match.tokens, elapsed * 1000.0)
        log.info("heads: %s on %s slot %d (%s)", restored.reason(), upstream.label, slot, entry.id)
        return restored

    async def _save_logged(
        self,
        upstream: Upstream,
        slot: int,
        pieces: tuple[bytes, ...],
        chars: tuple[int, ...],
        prompt_tokens: int,
        agent: str | None,
        project: str | None,
    ) -> None:
        try:
            await self._save(upstream, slot, pieces, chars, prompt_tokens, agent, project)
        except _FAILURES as exc:
            self.counts["failed"] += 1
            log.warning("heads: saving a head from %s failed: %s", upstream.label, exc)

    async def _save(
        self,
        upstream: Upstream,
        slot: int,
        pieces: tuple[bytes, ...],
        chars: tuple[int, ...],
        prompt_tokens: int,
        agent: str | None,
        project: str | None,
    ) -> None:
        links = chain(await self._key(upstream), pieces)
        if not links or covered(links, self._entries.values()):
            return
        # Wait for idle outside the lock: a new session's restore must not queue behind this wait.
        if await self._idle(upstream, wait_s=_IDLE_WAIT_S) is None:
            log.info("heads: %s stayed busy; the head is not saved", upstream.label)
            return
        async with self._lock:
            if await self._idle(upstream, wait_s=0.0) is None:
                return
            free = await asyncio.to_thread(lambda: shutil.disk_usage(self.dir).free)
            if free < _FREE_RESERVE_BYTES + self._bytes_per_token() * prompt_tokens * 2:
                self.counts["refused"] += 1
                log.warning("heads: %d MB free in %s; the head is not saved", free // 1_000_000, self.dir)
                return
            hid = head_id(links)
            name = f"{_SLOT_PREFIX}{hid}.bin"
            t0 = time.perf_counter()
            try:
                saved = await slot_action(self._client(), upstream, slot, "save", name, _ACTION_TIMEOUT)
                pause_ms = (time.perf_counter() - t0) * 1000.0
                n_saved = int(saved.get("n_saved") or 0)
                if n_saved < prompt_tokens:
                    raise SlotError(f"the slot held {n_saved} tokens, not the {prompt_tokens} of the head (reused)")
                size = await asyncio.to_thread(_take, self.slot_dir / name, self.dir / f"{hid}{SUFFIX}")
            finally:
                await asyncio.to_thread(_unlink, self.slot_dir / name)
            now = time.time()
            entry = HeadEntry(hid, links, chars, prompt_tokens, n_saved, size, now, now, agent, project)
            self._entries[hid] = entry
            for old in evictions(self._entries.values(), self.max_bytes):
                self._remove(old)
                self.counts["evicted"] += 1
            await asyncio.to_thread(self._write_index)
            if hid in self._entries:
                self.counts["saved"] += 1
                log.info(
                    "heads: saved a head of %d tokens (%d MB) from %s; the server paused %.0f ms",
                    prompt_tokens,
                    size // 1_000_000,
                    upstream.label,
                    pause_ms,
                )

    async def _key(self, upstream: Upstream) -> ServerKey:
        key = self._keys.get(upstream.base_url)
        if key is None:
            async with self._client().get(f"{upstream.base_url}/props", timeout=_ACTION_TIMEOUT) as resp:
                resp.raise_for_status()
                props = await resp.json(content_type=None)
            key = await asyncio.to_thread(_server_key, props)
            self._keys[upstream.base_url] = key
        return key

    async def _idle(self, upstream: Upstream, wait_s: float) -> int | None:
        """How many slots the server has once none is processing (a slot action pauses them all), waiting up to
        `wait_s`; None: still busy, or no `/slots` to ask."""
        deadline = time.monotonic() + wait_s
        while True:
            async with self._client().get(f"{upstream.base_url}/slots", timeout=_ACTION_TIMEOUT) as resp:
                slots = await resp.json(content_type=None) if resp.status == 200 else None
            if not isinstance(slots, list):
                return None
            if not any(isinstance(s, dict) and s.get("is_processing") for s in slots):
                return len(slots)
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(0.25)

    def _restore_bytes_per_s(self) -> float:
        return 1.0 / self._restore_s_per_byte if self._restore_s_per_byte else RESTORE_PRIOR_BYTES_PER_S

    def _observe_restore(self, size: int, seconds: float) -> None:
        if size >= 1_000_000 and seconds > 0:
            s_per_byte = seconds / size
            old = self._restore_s_per_byte
            self._restore_s_per_byte = s_per_byte if old is None else 0.7 * old + 0.3 * s_per_byte

    def _bytes_per_token(self) -> float:
        entries = list(self._entries.values())
        saved = sum(e.saved_tokens for e in entries)
        return sum(e.bytes for e in entries) / saved if saved else 120_000.0

    def _remove(self, head: str) -> bool:
        if self._entries.pop(head, None) is None:
            return False
        _unlink(self.dir / f"{head}{SUFFIX}")
        return True

    def _load(self) -> dict[str, HeadEntry]:
        """The index as the last run left it: entries whose file is gone are dropped, files no entry names removed."""
        try:
            raw = json.loads((self.dir / INDEX).read_text())
        except FileNotFoundError:
            raw = []
        except (OSError, ValueError) as exc:
            log.warning("heads: the index in %s is unreadable (%s); starting empty", self.dir, exc)
            raw = []
        entries: dict[str, HeadEntry] = {}
        for item in raw if isinstance(raw, list) else []:
            entry = HeadEntry.from_json(item)
            if entry is not None and (self.dir / f"{entry.id}{SUFFIX}").is_file():
                entries[entry.id] = entry
        for path in self.dir.glob(f"*{SUFFIX}"):
            if path.stem not in entries:
                _unlink(path)
        return entries

    def _write_index(self) -> None:
        tmp = self.dir / f".{INDEX}.tmp"
        data = json.dumps([e.to_json() for e in self._entries.values()])
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(data)
        os.replace(tmp, self.dir / INDEX)


def _server_key(props: Any) -> ServerKey:
    settings = props.get("default_generation_settings") or {}
    model = str(props.get("model_path") or "")
    try:
        size = Path(model).stat().st_size if model else 0
    except OSError:
        size = 0
    return ServerKey(
        model, size, int(settings.get("n_ctx") or 0), template_digest(str(props.get("chat_template") or ""))
    )


def _stage(head: Path, staged: Path) -> None:
    """The head under the slot directory for llama-server to read: a hard link where both share a filesystem."""
    _unlink(staged)
    try:
        os.link(head, staged)
    except OSError:
        shutil.copyfile(head, staged)


def _take(saved: Path, head: Path) -> int:
    """Move a slot file llama-server just wrote into the store, private to the user: its size."""
    os.chmod(saved, 0o600)
    try:
        os.replace(saved, head)
    except OSError:
        shutil.copyfile(saved, head)
        os.chmod(head, 0o600)
    return head.stat().st_size


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
