"""The head store's executor of what a served request asks of it (`AfterTurn`, decided by the router where the request
completes: `routing/move_planner.plan_save`): its tenant's share set, the head restored for it judged (an inert
restore learned, logged and told), its session's older state no longer waited for, and the `HeadSave` carried out — a
first turn's head saved at once in the background, a later turn's state once its session has been idle.

Nothing here decides whether a turn is saved; it keeps the guards of the moment the save runs: the slot's mark (a
request forwarded to that slot since the turn leaves another prompt there: the save is dropped), a head kept already
or being saved, and the slot I/O's own checks (an idle server, a file written whole)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp

from adaptive_spec.kv.heads.activity import INERT_HEAD_S, INERT_SERVER_S, SharedForwards, TurnMark, Verdict, alone_after
from adaptive_spec.kv.heads.book import HeadBook
from adaptive_spec.kv.heads.files import unlink
from adaptive_spec.kv.heads.matching import chain, covered_but_last, head_id
from adaptive_spec.kv.heads.slot_io import SLOT_PREFIX, SlotIO
from adaptive_spec.kv.heads.tables import HeadTables
from adaptive_spec.kv.heads.values import HeadsTold, Restored, SavedTurn
from adaptive_spec.kv.moves import AfterTurn, HeadSave
from adaptive_spec.kv.slots import SlotError
from adaptive_spec.llama.upstreams import Upstream

log = logging.getLogger(__name__)
_MAX_IDLE_SAVES = 1024  # sessions waiting to go idle (the oldest wait is dropped beyond it)
# What a save or restore may fail with: logged and counted, never raised into the request path.
FAILURES = (SlotError, OSError, aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError)


class AfterTurns:
    def __init__(
        self,
        io: SlotIO,
        book: HeadBook,
        tables: HeadTables,
        count: Callable[[str], None],
        told: HeadsTold,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
        tenants: bool,
        shared: SharedForwards | None = None,
    ) -> None:
        """The store's slot I/O, book and tables, its `count` and `spawn` (a background task it awaits at shutdown),
        whom it tells (`told`), whether projects are tenants (each with its share of the bound), and the forward
        counts all proxies keep (`shared`, where they share state: the judge of a restore compares them too)."""
        self._io, self._book, self._tables, self._count, self._told = io, book, tables, count, told
        self._spawn, self._tenants, self._shared = spawn, tenants, shared
        # Sessions whose state is saved once they have been idle a while: the timer, and the server it waits for.
        # Keyed by (tenant scope, session id): one tenant's session of a name is not another's.
        self._idle_saves: dict[tuple[str, str], tuple[asyncio.TimerHandle, str]] = {}

    @property
    def idle_waits(self) -> int:
        """Sessions whose state is saved when they have been idle a while."""
        return len(self._idle_saves)

    def carry_out(self, upstream: Upstream, after: AfterTurn) -> None:
        """What a served request on `upstream` asked for, done (its save in the background)."""
        if self._tenants:
            self._book.set_share(after.scope, after.share_bytes)  # the tenant's share, as its project's policy says
        if after.restored is not None:
            if after.inert:
                self._judge(upstream, after.restored, after.cache_n, after.mark)
            else:
                self._tables.reused(upstream.base_url)
        if after.session is not None:
            self._cancel((after.scope, after.session))  # a newer turn: the older state is not the session's any more
        save = after.save
        if save is None or save.server != upstream.base_url:
            return
        if not save.idle_s:
            # The turn's own mark: a request forwarded to its slot after it (even one served while the save waits for
            # the server to go idle) leaves the slot holding that request's KV, which is not this prompt's head.
            self._spawn(self._save_logged(upstream, save.at.slot, save.turn, save.mark))
        elif save.turn.session:
            self._save_when_idle(upstream, save)

    def server_down(self, server: str) -> None:
        """Its slots are gone: no session's state is saved from them."""
        for session in [s for s, (_, on) in self._idle_saves.items() if on == server]:
            self._cancel(session)

    def close(self) -> None:
        for session in list(self._idle_saves):
            self._cancel(session)

    # -- inside ---------------------------------------------------------------------------------------------------

    def _save_when_idle(self, upstream: Upstream, save: HeadSave) -> None:
        if len(self._idle_saves) >= _MAX_IDLE_SAVES:
            self._cancel(next(iter(self._idle_saves)))
        head, slot = save.turn, save.at.slot
        # No shared counts: where proxies share state, nothing is saved (`SlotIO.unchanged`).
        mark = save.mark if save.mark is not None else TurnMark(self._tables.mark(upstream.base_url, slot))

        def fire() -> None:
            self._idle_saves.pop((head.scope, head.session), None)
            self._spawn(self._save_state_logged(upstream, slot, head, mark))

        handle = asyncio.get_running_loop().call_later(save.idle_s, fire)
        self._idle_saves[(head.scope, head.session)] = (handle, upstream.base_url)

    def _cancel(self, session: tuple[str, str]) -> None:
        waiting = self._idle_saves.pop(session, None)
        if waiting is not None:
            waiting[0].cancel()

    def _judge(self, upstream: Upstream, restored: Restored, cache_n: int, mark: TurnMark | None) -> None:
        entry = self._book.entry(restored.head)
        scope = entry.scope if entry is not None else ""
        if self._shared is not None and not alone_after(mark.shared if mark else None, restored.counted):
            verdict, strikes = Verdict.TAKEN, 0  # another proxy's request may have come between: nothing is blamed
        else:
            verdict, strikes = self._tables.judge(upstream.base_url, restored, scope, time.monotonic())
        if verdict is Verdict.TAKEN:
            self._count("taken")
            log.warning(
                "heads: another request took %s's slot between the restore of %s and its request (reused %d of %d)",
                *(upstream.label, restored.head, cache_n, restored.tokens),
            )
            return
        self._count("inert")
        self._told.inert(
            upstream.base_url, restored.head, INERT_HEAD_S, INERT_SERVER_S if verdict is Verdict.INERT else 0
        )
        if verdict is Verdict.HEAD:
            log.warning(
                "heads: %s restored %s (%d tokens) but the prompt reused %d; the server reuses others, so only that "
                "head is not restored there for an hour",
                *(upstream.label, restored.head, restored.tokens, cache_n),
            )
            return
        then = (
            "that head is not restored there for an hour"
            if verdict is Verdict.STRIKE
            else "restores pause there for 10 minutes"
        )
        log.warning(
            "heads: %s restored a head of %d tokens but the prompt reused %d (%d heads in a row; %s)",
            *(upstream.label, restored.tokens, cache_n, strikes, then),
        )

    async def _save_logged(self, upstream: Upstream, slot: int | None, head: SavedTurn, mark: TurnMark | None) -> None:
        try:
            await self.save(upstream, slot, head, mark)
        except FAILURES as exc:
            self._count("failed")
            log.warning("heads: saving a head from %s failed (nothing kept): %s", upstream.label, exc)

    async def _save_state_logged(self, upstream: Upstream, slot: int | None, head: SavedTurn, mark: TurnMark) -> None:
        if self._tables.mark(upstream.base_url, slot) != mark.local:
            self._count("dropped")
            log.info("heads: session %s's state is not saved: its slot served another request since", head.session)
            return
        try:
            await self.save(upstream, slot, head, mark)
        except FAILURES as exc:
            self._count("failed")
            log.warning("heads: saving session %s's state from %s failed: %s", head.session, upstream.label, exc)

    async def save(self, upstream: Upstream, slot: int | None, head: SavedTurn, mark: TurnMark | None = None) -> None:
        """`mark`: the turn's (`HeadStore.ended`); the slot is saved only if it served nothing since that turn (None: a
        turn not forwarded through `forwarded`, judged by the requests forwarded during the save alone; never saved
        where proxies share state)."""
        if mark is not None and self._tables.mark(upstream.base_url, slot) != mark.local:
            self._count("dropped")
            return  # its slot served another request already: a later turn of the same head may be kept instead
        key = await self._io.key(upstream)
        if key is None:
            return  # its model cannot be known by content here: nothing is kept for it
        links = chain(key, head.pieces, head.scope)
        if not links or self._io.covered(upstream, links) or self._book.saving(head_id(links)):
            return  # kept already, or being saved: one save of a head at a time, so its files are its own
        if not head.session and covered_but_last(links, head.chars, self._io.usable(upstream)):
            return  # the head is kept; this session's first message alone is not worth a file of its size
        hid = head_id(links)
        self._book.save_started(hid)
        try:
            held = await self._io.save_idle(upstream, slot, head, (key, links), mark)
            if held is not None:
                self._tables.hold(upstream.base_url, slot or 0, held)
                if (entry := self._book.entry(hid)) is not None:
                    self._told.saved(entry, self._book.path(hid))
        finally:
            self._book.save_ended(hid)
            await asyncio.to_thread(unlink, self._io.slot_dir / f"{SLOT_PREFIX}{hid}.bin")
