"""The router's effects on the KV layer: what `routing/router.py` asks while it plans a handoff or a remote prefill
(its `Effects` protocol: whether a slot can move, and the remote prefill's prices), and the moves themselves, carried
out for the request path (`requests/carry_out.py`'s `Mover`).

This module resolves profiles to servers, runs the movers and remote prefill, and never raises into a request: any
failure comes back as a result that says so (the request then re-prefills, which is always correct). It also sweeps slot
files left behind."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import aiohttp

from adaptive_spec.kv.movers import MoveRequest, SharedDirMover, SlotMover
from adaptive_spec.kv.moves import HandoffResult, PrefillAsk, RemotePrefillResult, SlotAt, SlotMove
from adaptive_spec.kv.remote_prefill.pricing import RemoteCosts
from adaptive_spec.kv.remote_prefill.shell import RemotePrefill
from adaptive_spec.kv.slot_files import SLOT_FILE_PREFIX, slot_file_name
from adaptive_spec.kv.slots import SlotError
from adaptive_spec.llama.upstreams import UpstreamTable
from adaptive_spec.telemetry.events import Event, RemotePrefillDone

log = logging.getLogger(__name__)
_STALE_SLOT_FILE_S = 300.0


class KvEffects:
    """Slot moves through `mover` (the shared slot directory's by default), remote prefill through `remote`: the
    router's `Effects` and the request path's `Mover` in one (both ask the same table and movers)."""

    def __init__(
        self,
        table: UpstreamTable,
        client: Callable[[], aiohttp.ClientSession],
        publish: Callable[[Event], None] = lambda _e: None,
        slot_dir: Path | None = None,
        mover: SlotMover | None = None,
        remote: RemotePrefill | None = None,
    ) -> None:
        self.table, self._client, self._publish, self.slot_dir = table, client, publish, slot_dir
        self.mover: SlotMover | None = mover or (SharedDirMover(slot_dir) if slot_dir is not None else None)
        self.remote = remote
        self._seq = 0

    def publish(self, event: Event) -> None:
        self._publish(event)

    def can_move(self, source: SlotAt, target: SlotAt) -> bool:
        """Whether a slot file saved by one server can be restored by the other (a router-mode preset, `URL#MODEL`,
        takes no slot actions)."""
        if self.mover is None:
            return False
        there, here = self.table.get(source.profile, source.replica), self.table.get(target.profile, target.replica)
        return there is not None and here is not None and self.mover.can_move(there, here)

    def transfers(self, source: SlotAt, target: SlotAt) -> bool:
        """Whether that file crosses hosts (the cost model adds its transfer)."""
        if self.mover is None:
            return False
        there, here = self.table.get(source.profile, source.replica), self.table.get(target.profile, target.replica)
        return there is not None and here is not None and self.mover.transfers(there, here)

    async def move_slot(self, move: SlotMove) -> HandoffResult:
        """Save, transfer, restore; the file goes whatever the outcome."""
        there = self.table.get(move.source.profile, move.source.replica)
        here = self.table.get(move.target.profile, move.target.replica)
        if there is None or here is None or self.mover is None:
            return HandoffResult(False, 0, 0.0, 0.0, "nothing to hand over")
        self._seq += 1
        name = slot_file_name(move.session_id, self._seq)
        request = MoveRequest(
            there, move.source.slot or 0, here, move.target.slot or 0, name, move.timeout_s, move.min_tokens
        )
        try:
            moved = await self.mover.move(self._client(), request)
        except (aiohttp.ClientError, TimeoutError, ValueError, TypeError, SlotError) as exc:
            return HandoffResult(False, move.cached_tokens, 0.0, 0.0, str(exc) or type(exc).__name__)
        finally:
            # The target slot was overwritten (or half so) whatever the outcome; the file goes now, and once more
            # later in case llama-server was still writing it when we gave up waiting (`sweep`).
            await self.mover.discard(name)
        return HandoffResult(
            True, moved.n_saved, moved.save_s, moved.restore_s, transfer_s=moved.transfer_s, bytes=moved.bytes
        )

    @property
    def prefills_elsewhere(self) -> RemoteCosts | None:
        return self.remote.costs if self.remote is not None else None

    async def prefill_elsewhere(self, ask: PrefillAsk) -> RemotePrefillResult | None:
        """The remote prefill the router decided (`serve --pp-server`); None: no remote here for that server."""
        upstream = self.table.get(ask.at.profile, ask.at.replica)
        if self.remote is None or upstream is None:
            return None
        result = await self.remote.run(self._client(), ask, upstream)
        relay = self.remote.relay.base_url  # the event is the result, and where it was made
        self._publish(
            RemotePrefillDone(session_id=ask.session_id, profile=ask.at.profile, relay=relay, **asdict(result))
        )
        return result

    def sweep(self) -> int:
        """Delete slot files of moves given up while llama-server still wrote them (file I/O: off the event loop).
        Returns how many went."""
        if self.slot_dir is None:
            return 0
        now, gone = time.time(), 0
        for path in self.slot_dir.glob(f"{SLOT_FILE_PREFIX}*.bin"):
            try:
                if now - path.stat().st_mtime > _STALE_SLOT_FILE_S:
                    path.unlink()
                    gone += 1
            except OSError:
                continue
        return gone
