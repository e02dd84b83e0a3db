"""The head store's slot I/O: a head's file staged into the slot directory and restored into a slot, a slot saved and
its file moved out, each checked against what llama-server says it did, with what the store learns from them (the
restore rate, heads a server refused; the head a slot holds after a save is returned to the store, which keeps it).

`HeadStore` decides when; this does it, and raises what went wrong for the store to log. It reads the servers' traffic
from the store's tables (`HeadTables`: asked, never changed here) and keeps no table of the store's."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import aiohttp

from adaptive_spec.errors import ModelError
from adaptive_spec.kv.heads.activity import SharedForwards, TurnMark
from adaptive_spec.kv.heads.book import HeadBook
from adaptive_spec.kv.heads.files import stage, take, unlink
from adaptive_spec.kv.heads.matching import (
    RESTORE_PRIOR_BYTES_PER_S,
    HeadEntry,
    Match,
    ServerKey,
    block_chains,
    covered,
    earlier_states,
    head_id,
)
from adaptive_spec.kv.heads.server import TIMEOUT, idle_slots, key_of, model_path, restore_timeout, server_props
from adaptive_spec.kv.heads.tables import HeadTables
from adaptive_spec.kv.heads.values import HeadsConfig, Restored, SavedTurn
from adaptive_spec.kv.slot_files import file_sha256, known_sha256
from adaptive_spec.kv.slots import SlotError, check_written, restore_slot, save_slot
from adaptive_spec.llama.memory.gguf_info import model_dims
from adaptive_spec.llama.upstreams import Upstream

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 20.0  # a save waits this long for the server to go idle, else it is skipped
SLOT_PREFIX = "head-"  # the name a head has in the slot directory while it is restored or saved
_SAVED_SLACK_TOKENS = 8  # a slot holds the prompt and the reply; a few more (a stop sequence's): still the request's


class SlotIO:
    """One store's slot actions and what they taught it; the store holds the lock that runs one at a time."""

    def __init__(
        self,
        config: HeadsConfig,
        slot_dir: Path,
        client: Callable[[], aiohttp.ClientSession],
        book: HeadBook,
        count: Callable[[str, int], None],
        tables: HeadTables,
        on_displaced: Callable[[Upstream], None],
        shared: SharedForwards | None = None,
    ) -> None:
        """`count`: where its operations are counted (the store's counts); `tables`: the store's, which count each
        server's traffic; `on_displaced`: told when a slot action may have acted on a request's KV (`came_between`);
        `shared`: the forward counts all proxies keep, where they share state (`unchanged`)."""
        self.config, self.slot_dir, self._client, self.book, self._count = config, slot_dir, client, book, count
        self._tables, self._on_displaced, self._shared = tables, on_displaced, shared
        self._refused: set[tuple[str, str]] = set()  # (server, head): llama-server refused it there this run
        self.lock = asyncio.Lock()  # one save or restore at a time: each pauses the server's slots
        self._keys: dict[str, ServerKey] = {}
        self._hashing: dict[str, asyncio.Task[str | None]] = {}  # model path -> its sha256 (None: not readable here)
        self._unknown: set[str] = set()  # servers whose model cannot be known by content here: no heads for them
        self._any_prefix: dict[str, bool] = {}  # servers that resume a restored slot at any token (`any_prefix`)
        self._restore_s_per_byte: float | None = None

    def forget_key(self, server: str) -> None:
        self._keys.pop(server, None)

    async def restore_file(
        self, upstream: Upstream, slot: int, match: Match, forwards: int, used: bool = True
    ) -> Restored | None:
        """`forwards`: the requests forwarded to the server when it was found idle, before this restore."""
        entry = match.entry
        if not await self.book.check(entry):
            return None
        name = f"{SLOT_PREFIX}{entry.id}.bin"
        staged = self.slot_dir / name
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(stage, self.book.path(entry.id), staged)
            timeout = restore_timeout(entry.bytes)
            await restore_slot(self._client(), upstream, slot, name, timeout, entry.saved_tokens)
        except SlotError:  # its checksum holds: refused here (another build's format, a server's error), kept
            self._refused.add((upstream.base_url, entry.id))
            raise
        finally:
            await asyncio.to_thread(unlink, staged)
            if self._tables.forwarded_to(upstream.base_url) != forwards:
                self.came_between(upstream, "restore")
        elapsed = time.perf_counter() - t0
        self.observe_restore(entry.bytes, elapsed)
        if used:
            await self.book.used(entry)
        self.book.count("restored", entry.scope)
        restored = Restored(
            entry.id,
            upstream.base_url,
            match.tokens,
            elapsed * 1000.0,
            forwards=self._tables.forwarded_to(upstream.base_url),
            pieces=match.pieces,
            blocks=match.blocks,
            head_tokens=entry.prompt_tokens,
        )
        log.info("heads: %s on %s slot %d (%s)", restored.reason(), upstream.label, slot, entry.id)
        return restored

    async def save_idle(
        self,
        upstream: Upstream,
        slot: int | None,
        head: SavedTurn,
        keyed: tuple[ServerKey, tuple[str, ...]],
        mark: TurnMark | None = None,
    ) -> Restored | None:
        """The slot saved once the server is idle, under the lock; the file's move, its checksum and the index after
        it, outside the lock (in threads): a restore is never skipped for them. Returns the head the slot holds now
        (None: nothing kept), for the store to keep."""
        # Wait for idle outside the lock: a new session's restore must not queue behind this wait.
        if await self.idle(upstream, wait_s=_IDLE_WAIT_S) is None:
            log.info("heads: %s stayed busy; the head is not saved", upstream.label)
            return None
        key, links = keyed
        hid = head_id(links)
        async with self.lock:
            forwards = self._tables.forwarded_to(upstream.base_url)
            n_slots = await self.idle(upstream, wait_s=0.0)
            if self.covered(upstream, links) or n_slots is None or (slot is None and n_slots != 1):
                return None  # the same head was saved meanwhile, a request came, or its slot is not known among several
            if not await self.unchanged(upstream, slot, mark):
                self._count("dropped", 1)
                return None  # the session's slot served another request while the server was busy
            if not await self.book.room(head.prompt_tokens, head.scope, key.hex()):
                return None
            n_saved, n_written, pause_ms = await self.save_slot(upstream, slot or 0, head, hid, forwards)
            if self._shared is not None and not await self.unchanged(upstream, slot, mark):
                self._count("dropped", 1)  # another proxy's request came during the save: the file may hold its KV
                return None  # (the store removes the file from the slot directory)
        name = self.slot_dir / f"{SLOT_PREFIX}{hid}.bin"
        await asyncio.to_thread(check_written, name, n_written, upstream.label)
        size, crc = await asyncio.to_thread(take, name, self.book.path(hid))
        now = time.time()
        entry = HeadEntry(
            hid, links, head.chars, head.prompt_tokens, n_saved, size, now, now, head.agent, head.project, 0,
            key.hex(), crc, pause_ms, head.scope, head.session, block_chains(key, links, head.blocks, head.scope),
        )  # fmt: skip
        await self.book.add(entry)
        self._refused.difference_update([r for r in self._refused if r[1] == hid])  # a new file under that id
        kept = self.book.entry(hid)
        if kept is not None and head.session:
            await self.book.delete(earlier_states(self.book.heads(), kept))
        if self.book.entry(hid) is None:
            return None
        self.book.count("session_saved" if head.session else "saved", head.scope)
        log.info(
            "heads: saved %s of %d tokens (%d MB) from %s; the server paused %.0f ms",
            f"session {head.session}'s state" if head.session else "a head",
            head.prompt_tokens,
            size // 1_000_000,
            upstream.label,
            pause_ms,
        )
        return Restored(
            hid, upstream.base_url, head.prompt_tokens, 0.0, False, self._tables.forwarded_to(upstream.base_url)
        )

    async def save_slot(
        self, upstream: Upstream, slot: int, head: SavedTurn, hid: str, forwards: int
    ) -> tuple[int, object, float]:
        """The slot saved as the head's file: (tokens, bytes written as llama-server says, ms the server paused).
        `forwards`: the requests forwarded to the server when it was found idle; one more by the save's answer means
        llama-server may have deferred the save behind it, and saved that request's KV: SlotError."""
        most, t0 = head.prompt_tokens + head.reply_tokens + _SAVED_SLACK_TOKENS, time.perf_counter()
        name = f"{SLOT_PREFIX}{hid}.bin"
        n_saved, n_written = await save_slot(self._client(), upstream, slot, name, TIMEOUT, head.prompt_tokens)
        pause_ms = (time.perf_counter() - t0) * 1000.0
        if self._tables.forwarded_to(upstream.base_url) != forwards:
            raise SlotError("a request came during the save: the slot may have held its KV, not the head's")
        if n_saved > most:
            raise SlotError(f"the slot held {n_saved} tokens, more than the head's turn ({most}): reused")
        return n_saved, n_written, pause_ms

    async def unchanged(self, upstream: Upstream, slot: int | None, mark: TurnMark | None) -> bool:
        """Whether the slot served nothing since the turn of `mark` (None: only the requests forwarded during the save
        are known, and with state shared nothing is saved): nothing this proxy forwarded since, and where proxies
        share state, nothing any of them booked (the shared counts read now, one round trip; unreadable: changed)."""
        if mark is not None and self._tables.mark(upstream.base_url, slot) != mark.local:
            return False
        if self._shared is None:
            return True
        if mark is None or mark.shared is None:
            return False
        return mark.shared.unchanged(await self._shared.read(upstream.base_url, slot), slot)

    def covered(self, upstream: Upstream, links: Sequence[str]) -> bool:
        """A head already holds the prompt (one llama-server refused here does not count: a save replaces it)."""
        return covered(links, self.usable(upstream))

    def usable(self, upstream: Upstream) -> list[HeadEntry]:
        return [e for e in self.book.heads() if (upstream.base_url, e.id) not in self._refused]

    def came_between(self, upstream: Upstream, action: str) -> None:
        """A request was forwarded while a slot action waited: llama-server may have deferred the action behind it
        and acted on that request's KV. The router is told the server's slots hold nothing it knows of."""
        log.warning("heads: a request came to %s during a %s: its slots are counted as emptied", upstream.label, action)
        self._on_displaced(upstream)

    async def key(self, upstream: Upstream, wait: bool = True) -> ServerKey | None:
        """The key a head of this server is valid under; None until its model's sha256 is known (read once, in a
        thread, in the background; `wait` False: on a request's path nothing waits for it), and for good when the
        file cannot be read here (an attached server's on another host): no head is saved or restored there."""
        key = self._keys.get(upstream.base_url)
        if key is not None:
            return key
        props = await server_props(self._client(), upstream)
        sha = await self._model_sha256(model_path(props), wait)
        if sha is None:
            if wait and upstream.base_url not in self._unknown:
                self._unknown.add(upstream.base_url)
                log.warning(
                    "heads: off for %s: its model file (%s) cannot be read here, so its weights cannot be known by "
                    "content; no head is saved or restored there",
                    upstream.label,
                    model_path(props) or "not named by /props",
                )
            return None
        key = key_of(props, self.config.build, self.config.cache_types, sha)
        self._any_prefix[upstream.base_url] = await asyncio.to_thread(_any_prefix, model_path(props))
        self._keys[upstream.base_url] = key
        return key

    def any_prefix(self, upstream: Upstream) -> bool:
        """Whether the server resumes a restored slot at any token the new prompt shares with it (a dense target): a
        recurrent or sliding-window cache resumes only at a context checkpoint at or before that point, and a head's
        checkpoints sit at its own prompt's end, so a prompt that parts from it inside a piece reuses nothing there
        (measured: docs/benchmarks.md, "A new project of a known agent"). Known once its key is (`key`)."""
        return self._any_prefix.get(upstream.base_url, False)

    async def _model_sha256(self, model: str, wait: bool) -> str | None:
        if not model:
            return None
        task = self._hashing.get(model)
        if task is None:
            known = await asyncio.to_thread(_known_or_none, Path(model), self.config.digests)  # a stat, a small read
            if known is not None:
                return known
            task = self._hashing[model] = asyncio.get_running_loop().create_task(
                asyncio.to_thread(_sha256_or_none, Path(model), self.config.digests)
            )
        if task.done():
            result = task.result()
            if result is None:
                del self._hashing[model]  # a file that comes back (a remount) is asked again later
            return result
        return await asyncio.shield(task) if wait else None

    async def idle(self, upstream: Upstream, wait_s: float) -> int | None:
        return await idle_slots(self._client(), upstream, wait_s)

    def restore_bytes_per_s(self) -> float:
        return 1.0 / self._restore_s_per_byte if self._restore_s_per_byte else RESTORE_PRIOR_BYTES_PER_S

    def observe_restore(self, size: int, seconds: float) -> None:
        if size >= 1_000_000 and seconds > 0:
            s_per_byte = seconds / size
            old = self._restore_s_per_byte
            self._restore_s_per_byte = s_per_byte if old is None else 0.7 * old + 0.3 * s_per_byte


def _any_prefix(model: str) -> bool:
    """A dense model's cache resumes at any token; not one with recurrent or sliding-window layers (they resume at a
    context checkpoint; with `--swa-full`, measured, a split three quarters in resumed there but one a fifth in at
    nothing: docs/benchmarks.md), nor one whose GGUF header cannot be read."""
    try:
        dims = model_dims(Path(model))
    except ModelError:
        return False
    return dims.recurrent_layers == 0 and dims.swa_layers == 0


def _known_or_none(path: Path, kept: Path | None) -> str | None:
    try:
        return known_sha256(path, kept)
    except OSError:
        return None


def _sha256_or_none(path: Path, kept: Path | None) -> str | None:
    try:
        return file_sha256(path, kept)
    except OSError:
        return None
