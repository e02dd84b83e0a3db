"""The head store's shell: head files and their index in a directory of the state directory (`kv/heads/book.py`), saved
from an idle llama-server's slot after a session's first turn (or its state once it is idle), restored into a new
session's slot before its first turn is forwarded, and into a fresh server's idle slots when it (re)starts.

Every failure here is logged with its reason and ends in an ordinary request (a re-prefill): nothing raises into the
request path, and a head that llama-server refuses or that fails its checks is removed. llama-server only reads and
writes `--slot-save-path`, so a head is linked (or copied) there as `head-<id>.bin` only for the restore, and moved out
of it after the save: the sweeps of `as-*` files never see a head.

The store is the I/O executor of its tables (`kv/heads/tables.py`: the servers' traffic, the head each slot holds,
the first requests under way, the verdicts on inert restores, changed only through their methods): it asks the tables,
does the slow work (files through the book, the slot API through the slot I/O, under its lock) and tells the tables
what came of it. A restore is the router's decision (`kv/heads/choice.py`), shown what the tables hold (`view`); so is
a save, decided where a request completes (`routing/move_planner.plan_save`), shown what the tables held of that
request (`ended`), and carried out with its guards of the moment by `kv/heads/after_turn.py` (`after_turn`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import aiohttp

from adaptive_spec.kv.heads.activity import SharedForwards, TurnMark
from adaptive_spec.kv.heads.after_turn import FAILURES, AfterTurns
from adaptive_spec.kv.heads.book import HeadBook
from adaptive_spec.kv.heads.files import sweep_slot_files
from adaptive_spec.kv.heads.matching import (
    NO_TENANT,
    HeadEntry,
    Match,
    most_recent,
    tenant_scope,
)
from adaptive_spec.kv.heads.server import fresh, slot_free
from adaptive_spec.kv.heads.slot_io import SLOT_PREFIX, SlotIO
from adaptive_spec.kv.heads.tables import HeadTables
from adaptive_spec.kv.heads.values import HeadsConfig, HeadsTold, HeadsView, NoOneTold, Restored, TurnShown
from adaptive_spec.kv.moves import AfterTurn, HeadRestore
from adaptive_spec.llama.upstreams import Upstream

log = logging.getLogger(__name__)
_LOCK_WAIT_S = 2.0  # a restore waits at most this long for another save or restore (each pauses the slots briefly)


class HeadStore:
    def __init__(
        self,
        config: HeadsConfig,
        slot_dir: Path,
        client: Callable[[], aiohttp.ClientSession],
        say: Callable[[str], None] = log.info,
        displaced: Callable[[Upstream], None] = lambda _upstream: None,
        told: HeadsTold | None = None,
        shared: SharedForwards | None = None,
    ) -> None:
        """`displaced`: told when a slot action the server deferred behind a request acted on that request's KV (the
        proxy tells its router: that server's slots hold nothing it knows of); `told`: the other proxies' head stores
        (shared state), told what they should know; `shared`: the forward counts all proxies keep (shared state): a
        save's and a restore's guards compare them too, and nothing is saved where they cannot be read."""
        if config.directory is None:
            raise ValueError("HeadsConfig.directory: resolve the state directory's heads/ first")
        self.config, self.slot_dir, self._client, self._say = config, slot_dir, client, say
        self._counts = dict.fromkeys(
            (
                "saved",
                "session_saved",
                "restored",
                "warm_started",
                "warm_left",  # a fresh server another proxy warm-starts (shared state)
                "refused",
                "failed",
                "removed",
                "inert",
                "inert_heard",  # another proxy's verdict (shared state)
                "taken",
                "evicted",
                "dropped",  # a save given up: its slot served another request after the turn
            ),
            0,
        )
        tenants = len(set(config.project_keys.values()) | {NO_TENANT}) if config.project_keys else 1
        self.told = told or NoOneTold()
        self.book = HeadBook(config.directory, config.max_bytes, self._count, tenants, self.told.gone)
        with contextlib.suppress(OSError):  # what a save or restore cut short left in the slot directory
            if swept := sweep_slot_files(slot_dir, SLOT_PREFIX):
                log.info("heads: %d slot files a cut save or restore left in %s removed", swept, slot_dir)
        # What was forwarded to each server, its restarts, its inert restores: changed by the store, asked by its I/O.
        self._tables = HeadTables(tenants=bool(config.project_keys))
        self._shared = shared
        self._io = SlotIO(config, slot_dir, client, self.book, self._count, self._tables, displaced, shared)
        self._tasks: set[asyncio.Task[Any]] = set()
        # What served turns ask for, carried out: their saves, the sessions waiting to go idle, inert restores judged.
        self._after = AfterTurns(
            self._io, self.book, self._tables, self._count, self.told, self._spawn, bool(config.project_keys), shared
        )
        self._verifying: asyncio.Task[None] | None = None  # the checksums of the heads the last run left
        self._lock = self._io.lock  # one save or restore at a time: each pauses the server's slots

    @property
    def counts(self) -> Mapping[str, int]:
        """The store's operations by outcome (saved, restored, failed, ...): a read-only view (the metrics read it)."""
        return MappingProxyType(self._counts)

    # -- the request path -----------------------------------------------------------------------------------------

    def scope_of(self, sent_keys: Iterable[str]) -> str:
        """The tenant scope of a request that sent these API keys (`tenant_scope`)."""
        return tenant_scope(sent_keys, self.config.project_keys)

    def arriving(self, session_id: str | None, upstream: Upstream, scope: str = "") -> bool:
        """Whether a restore may be tried for this request of a session: the first the store sees of it (a new
        session, or one resumed after `serve` restarted), or its first since its server restarted (which lost its
        KV). Its other requests find their own KV in their slot."""
        return session_id is not None and self._tables.arriving(scope, session_id, upstream.base_url)

    def forwarded(self, upstream: Upstream, slot: int | None = None, request_id: str | None = None) -> None:
        """Every request forwarded to a server, counted: one between a restore and its request took the slot, and
        one after a session's turn (to its slot, or to no slot named) leaves that slot holding another prompt."""
        self._tables.forwarded(upstream.base_url, slot, request_id)

    @contextlib.asynccontextmanager
    async def moving(self, upstream: Upstream, slot: int | None, *, locked: bool = True) -> AsyncIterator[None]:
        """A KV move into `slot` of `upstream` (a handoff's restore; a remote prefill's, `locked` False: it may run
        for minutes): under the store's lock (no head is saved or restored beside it), and counted as a use of that
        slot, so a save waiting on it is dropped and a head held there is not taken for there any more."""
        self._tables.forwarded(upstream.base_url, slot, None)
        if not locked:
            yield
            return
        async with self._lock:
            self._tables.forwarded(upstream.base_url, slot, None)  # and once more: a save may have ended meanwhile
            yield

    def begin(self, request_id: str, restored: Restored | None) -> None:
        self._tables.begin(request_id, restored)

    async def view(self, upstream: Upstream, session_id: str | None, scope: str = "") -> HeadsView | None:
        """What a route needs to decide a head restore on this server for a request of `session_id` (`HeadsView`):
        None where none may be tried (not the session's first request there: `arriving`; a router-mode preset;
        restores paused there; no head; the server's key not known yet: on a request's path nothing waits for it)."""
        if session_id is None or not self._tables.would_arrive(scope, session_id, upstream.base_url):
            return None
        self._verify()
        base, now = upstream.base_url, time.monotonic()
        if upstream.upstream_model is not None or self._tables.paused(base, now) or not self.book.heads():
            return None
        try:
            key = await self._io.key(upstream, wait=False)
        except FAILURES as exc:
            self._count("failed")
            log.warning("heads: restore on %s failed (the request prefills): %s", upstream.label, exc)
            return None
        if key is None:
            return None
        rate, any_prefix = self._io.restore_bytes_per_s(), self._io.any_prefix(upstream)
        return self._tables.view(base, key, scope, self._io.usable(upstream), rate, any_prefix, now)

    async def restore(self, upstream: Upstream, move: HeadRestore) -> Restored | None:
        """Carry out a head restore a route asked for (`kv/heads/choice.choose_head`): None when it is not made (the
        request prefills). Another save or restore under way is waited for only while waiting costs less than the
        prefill the restore saves, and `_LOCK_WAIT_S` at most (two sessions starting at once on two slots both get
        their head)."""
        try:
            return await self._restore(upstream, move)
        except FAILURES as exc:
            self._count("failed")
            log.warning("heads: restore on %s failed (the request prefills): %s", upstream.label, exc)
            return None

    def ended(self, request_id: str) -> TurnShown:
        """What the tables show of a request as it ends, for the router to decide its save on (`TurnShown`): whether it
        was a first one the store saw (and what was restored for it), and its slot's mark as it was forwarded (None:
        not forwarded through `forwarded`), with the shared counts its booking returned where proxies share state."""
        first, restored = self._tables.end(request_id)
        local = self._tables.mark_of(request_id)
        shared = self._shared.booked(request_id) if self._shared is not None else None
        return TurnShown(first, restored, TurnMark(local, shared) if local is not None else None)

    def after_turn(self, upstream: Upstream, after: AfterTurn) -> None:
        """Carry out what the router decided for a request `upstream` served (`routing/move_planner.plan_save`): its
        restore judged, its session's older state given up, its save made in the background (`kv/heads/after_turn.py`,
        which keeps the guards of the moment: the slot's mark, a head kept or being saved already)."""
        self._after.carry_out(upstream, after)

    def warm_start(
        self,
        upstream: Upstream,
        when: str,
        on_fresh: Callable[[], None] = lambda: None,
        restore: bool = True,
        after: Awaitable[int] | None = None,
    ) -> None:
        """A server (re)started: when it is fresh (`on_fresh` is told: its slots hold nothing), the heads most
        recently used under its key go into its idle slots (unless `restore` is False: a restart asked to empty it),
        in the background (a request never waits for it; one that comes first stops it). `after`: the proxy's own
        work on the server to wait for first, ending with the prompt tokens it prefilled (a speed measurement's:
        still fresh, as no session's KV is there)."""
        self._verify()
        self._spawn(self._warm_logged(upstream, when, on_fresh, restore, after))

    def server_down(self, upstream: Upstream) -> None:
        """Its slots are gone (no session's state is saved from them), and its key is asked again when it is back."""
        base = upstream.base_url
        self._io.forget_key(base)
        self._tables.restarted(base)
        self._after.server_down(base)

    def emptied(self, upstream: Upstream) -> None:
        """Its slots were erased: no head is held there any more."""
        self._tables.emptied(upstream.base_url)

    # -- what other proxies told (shared state) --------------------------------------------------------------------

    async def adopt(self, entry: HeadEntry, origin: Path) -> None:
        """A head another proxy saved, its file at `origin` (a folder this proxy reaches): kept here too, checked
        as it is taken; a failure is logged and leaves this store as it was."""
        try:
            if await self.book.adopt(entry, origin):
                log.info("heads: took %s (%d tokens) that another proxy saved", entry.id, entry.prompt_tokens)
        except FileNotFoundError:  # evicted or deleted there since it was told: nothing to take
            log.info("heads: another proxy's head %s is no longer in its folder", entry.id)
        except OSError as exc:
            log.warning("heads: another proxy's head %s could not be read: %s", entry.id, exc)

    async def heard_gone(self, heads: Sequence[str]) -> None:
        """Heads another proxy removed (damaged, or deleted by a user): removed here too."""
        await self.book.delete(heads, tell=False)

    def heard_inert(self, server: str, head: str, head_s: float, server_s: float) -> None:
        """Another proxy's restore of `head` on `server` was inert: not tried there for `head_s` (nor any for
        `server_s`)."""
        now = time.monotonic()
        self._tables.heard_inert(server, head, now + head_s, now + server_s if server_s > 0 else None)
        self._count("inert_heard")

    async def settled(self) -> None:
        """Wait for the saves and warm starts under way (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        self._after.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)
        self.book.close()

    # -- what /adaptive/heads shows and deletes -------------------------------------------------------------------

    def describe(self, scope: str | None = None) -> dict[str, Any]:
        """The heads of `scope` and its share of the bound; the store's counts, the saves under way and the servers
        judged inert only in the global view (`scope` None): one tenant learns nothing of another's traffic."""
        if scope is not None:
            return {**self.book.describe(scope), "max_bytes": self.book.share(scope)}
        return {
            **self.book.describe(scope),
            "counts": dict(self.counts),
            "pending": len(self._tasks),
            "idle_waits": self._after.idle_waits,  # sessions whose state is saved when they have been idle a while
            "inert_servers": self._tables.inert_servers(time.monotonic()),
        }

    async def delete(self, head: str | None, scope: str | None = None) -> int:
        """Remove one head (or all, `head` None) of `scope` (None: every scope): how many were removed."""
        mine = [e.id for e in self.book.heads() if scope is None or e.scope == scope]
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

    def _count(self, name: str, n: int = 1) -> None:
        """One more of `name` (the book and the slot I/O count through this too: the counts are the store's)."""
        self._counts[name] = self._counts.get(name, 0) + n

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restore(self, upstream: Upstream, move: HeadRestore) -> Restored | None:
        match, slot = move.match, move.at.slot
        if not self.book.verified(match.entry.id) and not await self.book.verify_one(match.entry):
            return None  # damaged (now removed) or replaced meanwhile: this request prefills
        if move.held is not None:  # the slot held the head since its server started: still, if no request came
            held = self._tables.holds(upstream.base_url, slot or 0, match.entry.id)
            return move.held if held is not None else None
        try:
            async with asyncio.timeout(max(0.0, min(_LOCK_WAIT_S, move.prefill_s - move.restore_s))):
                await self._lock.acquire()
        except TimeoutError:
            return None  # a long save or warm start holds the store: the request prefills rather than wait
        try:
            forwards = self._tables.forwarded_to(upstream.base_url)
            if slot is None:
                if await self._io.idle(upstream, wait_s=0.0) != 1:
                    return None  # busy, or several slots and none named: the request may land in another one
            elif not await slot_free(self._client(), upstream, slot):
                return None  # its slot is busy: the restore would wait behind that slot's request
            restored = await self._io.restore_file(upstream, slot or 0, match, forwards)
            if restored is not None and self._shared is not None:  # for `_judge`: did any other request come?
                restored = replace(restored, counted=await self._shared.read(upstream.base_url, slot))
            return restored
        finally:
            self._lock.release()

    async def _warm_logged(
        self,
        upstream: Upstream,
        when: str,
        on_fresh: Callable[[], None],
        restore: bool,
        after: Awaitable[int] | None,
    ) -> None:
        try:
            own_tokens = await asyncio.shield(after) if after is not None else 0
            await self._warm(upstream, when, on_fresh, restore, own_tokens)
        except FAILURES as exc:
            self._count("failed")
            log.warning("heads: the warm start of %s %s stopped: %s", upstream.label, when, exc)

    async def _warm(
        self, upstream: Upstream, when: str, on_fresh: Callable[[], None], restore: bool, own_tokens: int = 0
    ) -> None:
        self.server_down(upstream)
        if upstream.upstream_model is None and not isinstance(self.told, NoOneTold):
            await self._io.key(upstream)  # other proxies' heads may come any time: a request then finds its key known
        if upstream.upstream_model is not None or not await fresh(self._client(), upstream, own_tokens):
            return  # a server that has served prompts holds sessions' KV: a head must not displace it
        on_fresh()
        if self.config.project_keys:
            return  # projects are tenants: a slot warmed with one's head would serve it to any project's request
        inert = self._tables.paused(upstream.base_url, time.monotonic())
        if not (restore and self.config.warm_start) or inert or not self.book.heads():
            return
        await self._verify()
        key, t0 = await self._io.key(upstream), time.perf_counter()
        if key is None:
            return
        forwards = self._tables.forwarded_to(upstream.base_url)
        n_slots = await self._io.idle(upstream, wait_s=0.0) or 0
        verified = (e for e in self.book.heads() if self.book.verified(e.id))
        heads = most_recent(verified, key.hex(), n_slots)
        if heads and not await self.told.warm_claim(upstream.base_url):
            self._count("warm_left")  # its slots' heads are unknown here: a request's own restore is tried
            self._say(f"heads: another proxy warm-starts {upstream.label} {when} (shared state)")
            return
        done = 0
        for slot, entry in enumerate(heads):
            async with self._lock:
                came = self._tables.forwarded_to(upstream.base_url) != forwards
                if came or await self._io.idle(upstream, 0.0) is None:
                    break  # requests came: they go first, and may have taken the slots
                match = Match(entry, len(entry.links), entry.prompt_tokens)
                restored = await self._io.restore_file(upstream, slot, match, forwards, used=False)
            if restored is not None:
                self._tables.hold(upstream.base_url, slot, replace(restored, at_start=True))
                self._count("warm_started")
                done += 1
        if heads:
            self._say(
                f"heads: {done} of {len(heads)} heads restored into {upstream.label}'s idle slots {when} "
                f"in {time.perf_counter() - t0:.2f} s (in the background)"
            )
        else:
            self._say(
                f"heads: none of the {len(self.book.heads())} kept is of {upstream.label}'s model and settings "
                f"(its slots {when} stay empty)"
            )
