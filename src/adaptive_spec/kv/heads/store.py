"""The head store's shell: head files and their index in a directory of the state directory (`kv/heads/book.py`),
saved from an idle llama-server's slot after a session's first turn, restored into a new session's slot before its
first turn is forwarded, and into a fresh server's idle slots when it (re)starts. Every failure here is logged with
its reason and ends in an ordinary request (a re-prefill): nothing raises into the request path, and a head that
llama-server refuses or that fails its checks is removed. llama-server only reads and writes `--slot-save-path`, so a
head is linked (or copied) there as `head-<id>.bin` only for the restore, and moved out of it after the save: the
sweeps of `as-*` files never see a head."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from adaptive_spec.common.lru import LRU
from adaptive_spec.kv.heads.book import HeadBook
from adaptive_spec.kv.heads.files import stage, take, unlink
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
    covered_but_last,
    earlier_states,
    head_id,
    inert,
    most_recent,
    price,
    tenant_scope,
)
from adaptive_spec.kv.heads.server import TIMEOUT, fresh, idle_slots, restore_timeout, server_key, slot_free
from adaptive_spec.kv.slots import SlotError, check_written, restore_slot, save_slot
from adaptive_spec.llama.upstreams import Upstream

log = logging.getLogger(__name__)
_SLOT_PREFIX = "head-"  # the name a head has in the slot directory while it is restored or saved
_IDLE_WAIT_S = 20.0  # a save waits this long for the server to go idle, else it is skipped
_LOCK_WAIT_S = 2.0  # a restore waits at most this long for another save or restore (each pauses the slots briefly)
_MAX_IDLE_SAVES = 1024  # sessions waiting to go idle (the oldest wait is dropped beyond it)
_INERT_STRIKES = 2  # inert restores in a row on a server before restores stop there (one may be a lost race)
_SAVED_SLACK_TOKENS = 8  # a slot holds the prompt and the reply; a few more (a stop sequence's): still the request's
_FAILURES = (SlotError, OSError, aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError)


@dataclass(frozen=True, slots=True)
class HeadsConfig:
    directory: Path | None  # None: heads/ in the state directory (resolved where `serve` starts)
    max_bytes: int = DEFAULT_MAX_BYTES
    build: str = ""  # the launched binary's identity ("": attached servers, known by their build_info alone)
    cache_types: tuple[str, str] = ("", "")  # the launched servers' K and V cache types ("": unknown)
    warm_start: bool = True  # restore the most recent heads into a fresh server's idle slots (start, restart)
    # `serve --project-key` (key: project): projects are tenants, a head is found within its key's project only.
    project_keys: Mapping[str, str] = field(default_factory=dict, repr=False)


@dataclass(frozen=True, slots=True)
class Restored:
    """A head restored for one request: checked against that request's `cache_n` when it ends. `forwards`: the
    requests forwarded to that server before the restore (another one in between may have taken the slot)."""

    head: str
    server: str
    tokens: int
    restore_ms: float
    at_start: bool = False
    forwards: int = 0
    pieces: int = 0  # the request's leading pieces the head holds

    def reason(self) -> str:
        when = " when the server started" if self.at_start else ""
        return f"warm: head of {self.tokens} tokens restored{when} in {self.restore_ms:.0f} ms"


@dataclass(frozen=True, slots=True)
class _Head:
    """A served first turn to keep as a head: its prompt's pieces, its tokens and reply's, whose it is."""

    pieces: tuple[bytes, ...]
    chars: tuple[int, ...]
    prompt_tokens: int
    reply_tokens: int
    agent: str | None
    project: str | None
    scope: str
    session: str = ""  # "": an agent's head; else the session whose state this is (saved once it went idle)


class HeadStore:
    def __init__(
        self,
        config: HeadsConfig,
        slot_dir: Path,
        client: Callable[[], aiohttp.ClientSession],
        say: Callable[[str], None] = log.info,
    ) -> None:
        if config.directory is None:
            raise ValueError("HeadsConfig.directory: resolve the state directory's heads/ first")
        self.config, self.slot_dir, self._client, self._say = config, slot_dir, client, say
        self.counts = dict.fromkeys(
            (
                "saved",
                "session_saved",
                "restored",
                "warm_started",
                "refused",
                "failed",
                "removed",
                "inert",
                "taken",
                "evicted",
            ),
            0,
        )
        self.book = HeadBook(config.directory, config.max_bytes, self.counts)
        self._entries = self.book.entries  # the book's own dict: it adds and removes, the store reads
        self._keys: dict[str, ServerKey] = {}
        self._inert: set[str] = set()  # servers where restores were reported and reused nothing, `_INERT_STRIKES` times
        self._strikes: dict[str, int] = {}  # inert restores in a row, by server
        self._held: dict[tuple[str, int], Restored] = {}  # the head each server's slot holds (warm start, save)
        self._forwards: dict[str, int] = {}  # requests forwarded to each server
        self._unpinned: dict[str, int] = {}  # of those, the ones that named no slot (llama-server chose one)
        self._pinned: dict[tuple[str, int], int] = {}  # and the ones that named a slot, by slot
        self._generations: dict[str, int] = {}  # each server's restarts: a restarted server lost every session's KV
        # Sessions the store has seen: the server and its generation at their latest request.
        self._seen: LRU[str, tuple[str, int]] = LRU(100_000)
        # What had been forwarded that could use each request's slot, its own forward included (`_mark`): a later
        # one, even one sent while the request still ran, leaves that slot holding another prompt.
        self._marks: LRU[str, tuple[int, int]] = LRU(4096)
        # Sessions whose state is saved once they have been idle a while: the timer, and the server it waits for.
        self._idle_saves: dict[str, tuple[asyncio.TimerHandle, str]] = {}
        # First requests under way, and the head restored for each (bounded: one that raised never ends).
        self._firsts: LRU[str, Restored | None] = LRU(4096)
        self._refused: set[tuple[str, str]] = set()  # (server, head): llama-server refused it there this run
        self._restore_s_per_byte: float | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._verifying: asyncio.Task[None] | None = None  # the checksums of the heads the last run left
        self._lock = asyncio.Lock()  # one save or restore at a time: each pauses the server's slots
        # A slot action the server deferred behind a request acted on that request's KV: the router is told.
        self.displaced: Callable[[Upstream], None] = lambda _upstream: None

    # -- the request path -----------------------------------------------------------------------------------------

    def scope_of(self, sent_keys: Iterable[str]) -> str:
        """The tenant scope of a request that sent these API keys (`tenant_scope`)."""
        return tenant_scope(sent_keys, self.config.project_keys)

    def arriving(self, session_id: str | None, upstream: Upstream) -> bool:
        """Whether a restore may be tried for this request of a session: the first the store sees of it (a new
        session, or one resumed after `serve` restarted), or its first since its server restarted (which lost its
        KV). Its other requests find their own KV in their slot."""
        if session_id is None:
            return False
        now = (upstream.base_url, self._generations.get(upstream.base_url, 0))
        before = self._seen.get(session_id)
        self._seen.put(session_id, now)
        return before is None or (before[0] == now[0] and before[1] != now[1])

    def forwarded(self, upstream: Upstream, slot: int | None = None, request_id: str | None = None) -> None:
        """Every request forwarded to a server, counted: one between a restore and its request took the slot, and
        one after a session's turn (to its slot, or to no slot named) leaves that slot holding another prompt."""
        base = upstream.base_url
        self._forwards[base] = self._forwards.get(base, 0) + 1
        if slot is None:
            self._unpinned[base] = self._unpinned.get(base, 0) + 1
        else:
            self._pinned[(base, slot)] = self._pinned.get((base, slot), 0) + 1
        if request_id is not None:
            self._marks.put(request_id, self._mark(upstream, slot))

    def mark_of(self, request_id: str) -> tuple[int, int] | None:
        """The request's `_mark` as it was forwarded (None: not forwarded through `forwarded`)."""
        return self._marks.pop(request_id)

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
        scope: str = "",
    ) -> Restored | None:
        """Restore the stored head of `scope` sharing most with this prompt into `slot` when it pays; None otherwise.
        Another save or restore under way is waited for only while waiting costs less than the prefill the restore
        saves, and `_LOCK_WAIT_S` at most (two sessions starting at once on two slots both get their head)."""
        self._verify()
        if upstream.upstream_model is not None or upstream.base_url in self._inert or not self._entries:
            return None
        try:
            links = chain(await self._key(upstream), pieces, scope)
            return await self._restore(upstream, slot, links, slot_tokens, prefill_s_per_token)
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
        cache_n: int | None,
        tokens: tuple[int, int],
        restored: Restored | None,
        owner: tuple[str | None, str | None, str],
        min_tokens: int = MIN_HEAD_TOKENS,
        *,
        first: bool = True,
        session: str | None = None,
        idle_s: float = 0.0,
        mark: tuple[int, int] | None = None,
    ) -> None:
        """A session's request was served: learn an inert restore (`cache_n` None: not reported). Its `first` turn
        (no reply in its prompt yet) is saved as a head in the background, when it has `min_tokens` or more; any
        other turn of `session` that long is saved as the session's state once the session has been `idle_s`
        seconds without a request and its slot served nothing else since it was forwarded (`mark`, from `mark_of`;
        0: never). `tokens`: its prompt's and its reply's; `owner`: its agent, project and tenant scope."""
        if restored is not None and cache_n is not None:
            if inert(restored.tokens, cache_n):
                self._judge(upstream, restored, cache_n)
            else:
                self._strikes.pop(upstream.base_url, None)
        if session is not None:
            self._cancel_idle(session)  # a newer turn: the older state is not the session's any more
        if tokens[0] < min_tokens or upstream.upstream_model is not None:
            return
        head = _Head(tuple(pieces), tuple(chars), tokens[0], tokens[1], owner[0], owner[1], owner[2])
        if first:
            self._spawn(self._save_logged(upstream, slot, head))
        elif session and idle_s > 0:
            self._save_when_idle(upstream, slot, replace(head, session=session), idle_s, mark)

    def warm_start(
        self, upstream: Upstream, when: str, on_fresh: Callable[[], None] = lambda: None, restore: bool = True
    ) -> None:
        """A server (re)started: when it is fresh (`on_fresh` is told: its slots hold nothing), the heads most
        recently used under its key go into its idle slots (unless `restore` is False: a restart asked to empty it),
        in the background (a request never waits for it; one that comes first stops it)."""
        self._verify()
        self._spawn(self._warm_logged(upstream, when, on_fresh, restore))

    def server_down(self, upstream: Upstream) -> None:
        """Its slots are gone (no session's state is saved from them), and its key is asked again when it is back."""
        base = upstream.base_url
        self._keys.pop(base, None)
        self._generations[base] = self._generations.get(base, 0) + 1
        for session in [s for s, (_, on) in self._idle_saves.items() if on == base]:
            self._cancel_idle(session)
        self.emptied(upstream)

    def emptied(self, upstream: Upstream) -> None:
        """Its slots were erased: no head is held there any more."""
        self._held = {k: v for k, v in self._held.items() if k[0] != upstream.base_url}

    async def settled(self) -> None:
        """Wait for the saves and warm starts under way (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        for session in list(self._idle_saves):
            self._cancel_idle(session)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # -- what /adaptive/heads shows and deletes -------------------------------------------------------------------

    def describe(self, scope: str | None = None) -> dict[str, Any]:
        """The heads of `scope` (None: every scope), and the store's counts."""
        return {
            **self.book.describe(scope),
            "counts": dict(self.counts),
            "pending": len(self._tasks),
            "inert_servers": sorted(self._inert),
        }

    async def delete(self, head: str | None, scope: str | None = None) -> int:
        """Remove one head (or all, `head` None) of `scope` (None: every scope): how many were removed."""
        mine = [e.id for e in self._entries.values() if scope is None or e.scope == scope]
        return await self.book.delete(mine if head is None else [h for h in mine if h == head])

    # -- inside ---------------------------------------------------------------------------------------------------

    def _verify(self) -> asyncio.Task[None]:
        """The checksums of the heads the last run left, checked once, in the background (a head is restored only
        once its checksum is)."""
        if self._verifying is None:
            self._verifying = asyncio.get_running_loop().create_task(self.book.verify())
            self._tasks.add(self._verifying)
            self._verifying.add_done_callback(self._tasks.discard)
        return self._verifying

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _mark(self, upstream: Upstream, slot: int | None) -> tuple[int, int]:
        """What has been forwarded that could have used `slot` since: every request when no slot is named; else the
        requests that named no slot and those that named this one."""
        base = upstream.base_url
        if slot is None:
            return self._forwards.get(base, 0), 0
        return self._unpinned.get(base, 0), self._pinned.get((base, slot), 0)

    def _save_when_idle(
        self, upstream: Upstream, slot: int | None, head: _Head, idle_s: float, mark: tuple[int, int] | None
    ) -> None:
        if len(self._idle_saves) >= _MAX_IDLE_SAVES:
            self._cancel_idle(next(iter(self._idle_saves)))
        if mark is None:
            mark = self._mark(upstream, slot)

        def fire() -> None:
            self._idle_saves.pop(head.session, None)
            self._spawn(self._save_state_logged(upstream, slot, head, mark))

        handle = asyncio.get_running_loop().call_later(idle_s, fire)
        self._idle_saves[head.session] = (handle, upstream.base_url)

    def _cancel_idle(self, session: str) -> None:
        waiting = self._idle_saves.pop(session, None)
        if waiting is not None:
            waiting[0].cancel()

    def _judge(self, upstream: Upstream, restored: Restored, cache_n: int) -> None:
        if self._forwards.get(upstream.base_url, 0) != restored.forwards + 1:
            self.counts["taken"] += 1
            log.warning(
                "heads: another request took %s's slot between the restore of %s and its request (reused %d of %d)",
                upstream.label,
                restored.head,
                cache_n,
                restored.tokens,
            )
            return
        self.counts["inert"] += 1
        strikes = self._strikes[upstream.base_url] = self._strikes.get(upstream.base_url, 0) + 1
        if strikes < _INERT_STRIKES:
            log.warning(
                "heads: %s restored a head of %d tokens but the prompt reused %d (once: another such and restores "
                "stop there)",
                upstream.label,
                restored.tokens,
                cache_n,
            )
            return
        self._inert.add(upstream.base_url)
        log.warning(
            "heads: %s restored a head of %d tokens but the prompt reused %d, %d times in a row: no more restores "
            "there",
            upstream.label,
            restored.tokens,
            cache_n,
            strikes,
        )

    async def _restore(
        self,
        upstream: Upstream,
        slot: int | None,
        links: Sequence[str],
        slot_tokens: int,
        prefill_s_per_token: float,
    ) -> Restored | None:
        usable = (
            e
            for e in self._entries.values()
            if self.book.verified(e.id) and (upstream.base_url, e.id) not in self._refused
        )
        match = best_match(links, usable)
        if match is None:
            return None
        held = self._held.get((upstream.base_url, slot or 0))
        if held is not None and held.head == match.entry.id and held.forwards == self._forwards.get(held.server, 0):
            # The slot holds that head (a warm start put it there, or it was saved from there) and no request came
            # since: nothing to restore.
            return replace(held, tokens=match.tokens, pieces=match.pieces) if held.at_start else None
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
        try:
            async with asyncio.timeout(max(0.0, min(_LOCK_WAIT_S, cost.prefill_s - cost.restore_s))):
                await self._lock.acquire()
        except TimeoutError:
            return None  # a long save or warm start holds the store: the request prefills rather than wait
        try:
            forwards = self._forwards.get(upstream.base_url, 0)
            if slot is None:
                if await self._idle(upstream, wait_s=0.0) != 1:
                    return None  # busy, or several slots and none named: the request may land in another one
            elif not await slot_free(self._client(), upstream, slot):
                return None  # its slot is busy: the restore would wait behind that slot's request
            return await self._restore_file(upstream, slot or 0, match, forwards)
        finally:
            self._lock.release()

    async def _restore_file(
        self, upstream: Upstream, slot: int, match: Match, forwards: int, used: bool = True
    ) -> Restored | None:
        """`forwards`: the requests forwarded to the server when it was found idle, before this restore."""
        entry = match.entry
        if not await self.book.check(entry):
            return None
        name = f"{_SLOT_PREFIX}{entry.id}.bin"
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
            if self._forwards.get(upstream.base_url, 0) != forwards:
                self._came_between(upstream, "restore")
        elapsed = time.perf_counter() - t0
        self._observe_restore(entry.bytes, elapsed)
        if used:
            await self.book.used(entry)
        self.counts["restored"] += 1
        restored = Restored(
            entry.id,
            upstream.base_url,
            match.tokens,
            elapsed * 1000.0,
            forwards=self._forwards.get(upstream.base_url, 0),
            pieces=match.pieces,
        )
        log.info("heads: %s on %s slot %d (%s)", restored.reason(), upstream.label, slot, entry.id)
        return restored

    async def _warm_logged(self, upstream: Upstream, when: str, on_fresh: Callable[[], None], restore: bool) -> None:
        try:
            await self._warm(upstream, when, on_fresh, restore)
        except _FAILURES as exc:
            self.counts["failed"] += 1
            log.warning("heads: the warm start of %s %s stopped: %s", upstream.label, when, exc)

    async def _warm(self, upstream: Upstream, when: str, on_fresh: Callable[[], None], restore: bool) -> None:
        self.server_down(upstream)
        if upstream.upstream_model is not None or not await fresh(self._client(), upstream):
            return  # a server that has served prompts holds sessions' KV: a head must not displace it
        on_fresh()
        if self.config.project_keys:
            return  # projects are tenants: a slot warmed with one's head would serve it to any project's request
        if not (restore and self.config.warm_start) or upstream.base_url in self._inert or not self._entries:
            return
        await self._verify()
        key, t0 = await self._key(upstream), time.perf_counter()
        forwards = self._forwards.get(upstream.base_url, 0)
        n_slots = await self._idle(upstream, wait_s=0.0) or 0
        verified = (e for e in self._entries.values() if self.book.verified(e.id))
        heads = most_recent(verified, key.hex(), n_slots)
        done = 0
        for slot, entry in enumerate(heads):
            async with self._lock:
                if self._forwards.get(upstream.base_url, 0) != forwards or await self._idle(upstream, 0.0) is None:
                    break  # requests came: they go first, and may have taken the slots
                match = Match(entry, len(entry.links), entry.prompt_tokens)
                restored = await self._restore_file(upstream, slot, match, forwards, used=False)
            if restored is not None:
                self._held[(upstream.base_url, slot)] = replace(restored, at_start=True)
                self.counts["warm_started"] += 1
                done += 1
        if heads:
            self._say(
                f"heads: {done} of {len(heads)} heads restored into {upstream.label}'s idle slots {when} "
                f"in {time.perf_counter() - t0:.2f} s (in the background)"
            )

    async def _save_logged(self, upstream: Upstream, slot: int | None, head: _Head) -> None:
        try:
            await self._save(upstream, slot, head)
        except _FAILURES as exc:
            self.counts["failed"] += 1
            log.warning("heads: saving a head from %s failed (nothing kept): %s", upstream.label, exc)

    async def _save_state_logged(
        self, upstream: Upstream, slot: int | None, head: _Head, mark: tuple[int, int]
    ) -> None:
        if self._mark(upstream, slot) != mark:
            log.info("heads: session %s's state is not saved: its slot served another request since", head.session)
            return
        try:
            await self._save(upstream, slot, head, mark)
        except _FAILURES as exc:
            self.counts["failed"] += 1
            log.warning("heads: saving session %s's state from %s failed: %s", head.session, upstream.label, exc)

    async def _save(
        self, upstream: Upstream, slot: int | None, head: _Head, mark: tuple[int, int] | None = None
    ) -> None:
        """`mark`: a session's state, saved only if its slot served nothing since its turn (`_mark`)."""
        key = await self._key(upstream)
        links = chain(key, head.pieces, head.scope)
        if not links or self._covered(upstream, links) or head_id(links) in self.book.saving:
            return  # kept already, or being saved: one save of a head at a time, so its files are its own
        if not head.session and covered_but_last(links, head.chars, self._usable(upstream)):
            return  # the head is kept; this session's first message alone is not worth a file of its size
        hid = head_id(links)
        self.book.saving.add(hid)
        try:
            await self._save_idle(upstream, slot, head, (key, links), mark)
        finally:
            self.book.saving.discard(hid)
            await asyncio.to_thread(unlink, self.slot_dir / f"{_SLOT_PREFIX}{hid}.bin")

    async def _save_idle(
        self,
        upstream: Upstream,
        slot: int | None,
        head: _Head,
        keyed: tuple[ServerKey, tuple[str, ...]],
        mark: tuple[int, int] | None = None,
    ) -> None:
        """The slot saved once the server is idle, under the lock; the file's move, its checksum and the index after
        it, outside the lock (in threads): a restore is never skipped for them."""
        # Wait for idle outside the lock: a new session's restore must not queue behind this wait.
        if await self._idle(upstream, wait_s=_IDLE_WAIT_S) is None:
            log.info("heads: %s stayed busy; the head is not saved", upstream.label)
            return
        key, links = keyed
        hid = head_id(links)
        async with self._lock:
            forwards = self._forwards.get(upstream.base_url, 0)
            n_slots = await self._idle(upstream, wait_s=0.0)
            if self._covered(upstream, links) or n_slots is None or (slot is None and n_slots != 1):
                return  # the same head was saved meanwhile, a request came, or its slot is not known among several
            if mark is not None and self._mark(upstream, slot) != mark:
                return  # the session's slot served another request while the server was busy
            if not await self.book.room(head.prompt_tokens):
                return
            n_saved, n_written, pause_ms = await self._save_slot(upstream, slot or 0, head, hid, forwards)
        name = self.slot_dir / f"{_SLOT_PREFIX}{hid}.bin"
        await asyncio.to_thread(check_written, name, n_written, upstream.label)
        size, crc = await asyncio.to_thread(take, name, self.book.path(hid))
        now = time.time()
        entry = HeadEntry(
            hid, links, head.chars, head.prompt_tokens, n_saved, size, now, now, head.agent, head.project, 0,
            key.hex(), crc, pause_ms, head.scope, head.session,
        )  # fmt: skip
        await self.book.add(entry)
        self._refused = {r for r in self._refused if r[1] != hid}  # a new file under that id
        if hid in self._entries and head.session:
            await self.book.delete(earlier_states(self._entries.values(), head.session, hid))
        if hid in self._entries:
            self.counts["session_saved" if head.session else "saved"] += 1
            self._held[(upstream.base_url, slot or 0)] = Restored(
                hid, upstream.base_url, head.prompt_tokens, 0.0, False, self._forwards.get(upstream.base_url, 0)
            )
            log.info(
                "heads: saved %s of %d tokens (%d MB) from %s; the server paused %.0f ms",
                f"session {head.session}'s state" if head.session else "a head",
                head.prompt_tokens,
                size // 1_000_000,
                upstream.label,
                pause_ms,
            )

    async def _save_slot(
        self, upstream: Upstream, slot: int, head: _Head, hid: str, forwards: int
    ) -> tuple[int, object, float]:
        """The slot saved as the head's file: (tokens, bytes written as llama-server says, ms the server paused).
        `forwards`: the requests forwarded to the server when it was found idle; one more by the save's answer means
        llama-server may have deferred the save behind it, and saved that request's KV: SlotError."""
        most, t0 = head.prompt_tokens + head.reply_tokens + _SAVED_SLACK_TOKENS, time.perf_counter()
        name = f"{_SLOT_PREFIX}{hid}.bin"
        n_saved, n_written = await save_slot(self._client(), upstream, slot, name, TIMEOUT, head.prompt_tokens)
        pause_ms = (time.perf_counter() - t0) * 1000.0
        if self._forwards.get(upstream.base_url, 0) != forwards:
            raise SlotError("a request came during the save: the slot may have held its KV, not the head's")
        if n_saved > most:
            raise SlotError(f"the slot held {n_saved} tokens, more than the head's turn ({most}): reused")
        return n_saved, n_written, pause_ms

    def _covered(self, upstream: Upstream, links: Sequence[str]) -> bool:
        """A head already holds the prompt (one llama-server refused here does not count: a save replaces it)."""
        return covered(links, self._usable(upstream))

    def _usable(self, upstream: Upstream) -> list[HeadEntry]:
        return [e for e in self._entries.values() if (upstream.base_url, e.id) not in self._refused]

    def _came_between(self, upstream: Upstream, action: str) -> None:
        """A request was forwarded while a slot action waited: llama-server may have deferred the action behind it
        and acted on that request's KV. The router is told the server's slots hold nothing it knows of."""
        log.warning("heads: a request came to %s during a %s: its slots are counted as emptied", upstream.label, action)
        self.displaced(upstream)

    async def _key(self, upstream: Upstream) -> ServerKey:
        key = self._keys.get(upstream.base_url)
        if key is None:
            key = await server_key(self._client(), upstream, self.config.build, self.config.cache_types)
            self._keys[upstream.base_url] = key
        return key

    async def _idle(self, upstream: Upstream, wait_s: float) -> int | None:
        return await idle_slots(self._client(), upstream, wait_s)

    def _restore_bytes_per_s(self) -> float:
        return 1.0 / self._restore_s_per_byte if self._restore_s_per_byte else RESTORE_PRIOR_BYTES_PER_S

    def _observe_restore(self, size: int, seconds: float) -> None:
        if size >= 1_000_000 and seconds > 0:
            s_per_byte = seconds / size
            old = self._restore_s_per_byte
            self._restore_s_per_byte = s_per_byte if old is None else 0.7 * old + 0.3 * s_per_byte
