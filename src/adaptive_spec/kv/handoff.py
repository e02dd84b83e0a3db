"""The router's shell: the I/O around the pure router state (`routing/router.py`): the KV handoff (save the
slot on the server a session leaves, restore it on the one it goes to, through a `SlotMover`), the sweep of
left-over slot files, and policy reload."""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from adaptive_spec.kv.slot_mover import SharedDirMover, SlotError, SlotMover
from adaptive_spec.routing.decide import Decision
from adaptive_spec.routing.router import PolicySource, RouterState
from adaptive_spec.servers.upstreams import UpstreamTable
from adaptive_spec.telemetry.events import Event, HandoffDone, PolicyChanged

log = logging.getLogger(__name__)
_HANDOFF_BASE_TIMEOUT_S = 10.0
_SLOT_FILE_PREFIX = "as-"
_STALE_SLOT_FILE_S = 300.0


@dataclass(frozen=True, slots=True)
class HandoffResult:
    ok: bool
    tokens: int
    save_s: float
    restore_s: float
    error: str | None = None
    transfer_s: float = 0.0  # the slot file's trip between hosts (a relay mover)
    bytes: int = 0


class Router(RouterState):
    """The router's shell: the pure state plus slot save/restore, the slot-file sweep and policy reload."""

    def __init__(
        self,
        table: UpstreamTable,
        policies: PolicySource,
        slots: Mapping[str, int],
        spec_types: Mapping[str, tuple[str, ...] | None],
        slot_dir: Path | None = None,
        publish: Callable[[Event], None] = lambda _e: None,
        seed: int | None = None,
        replica_slots: Mapping[tuple[str, int], int] | None = None,
        mover: SlotMover | None = None,
        servers: Mapping[tuple[str, int], str] | None = None,
    ) -> None:
        super().__init__(table, policies, slots, spec_types, seed, replica_slots, servers)
        self.table, self.slot_dir, self.publish = table, slot_dir, publish
        # The seam for moving slots between hosts: a mover given here replaces the shared directory's.
        self.mover: SlotMover | None = mover or (SharedDirMover(slot_dir) if slot_dir is not None else None)
        self._handoff_seq = 0

    def _can_save(self, profile: str) -> bool:
        """Whether the profile's slots can be moved at all (a router-mode preset, `URL#MODEL`, takes no slot
        actions)."""
        upstream = self.table.get(profile)
        return self.mover is not None and upstream is not None and self.mover.can_move(upstream, upstream)

    def can_save(self, profile: str) -> bool:
        return self._can_save(profile)

    def _can_move(self, from_profile: str, from_replica: int, to_profile: str, to_replica: int) -> bool:
        source, target = self.table.get(from_profile, from_replica), self.table.get(to_profile, to_replica)
        return (
            self.mover is not None and source is not None and target is not None and self.mover.can_move(source, target)
        )

    def _transfers(self, from_profile: str, from_replica: int, to_profile: str, to_replica: int) -> bool:
        source, target = self.table.get(from_profile, from_replica), self.table.get(to_profile, to_replica)
        if self.mover is None or source is None or target is None:
            return False
        return self.mover.transfers(source, target)

    def slot_count(self, profile: str, replica: int = 0) -> int:
        return self._books[(profile, replica)].slots

    def slots_erased(self, profile: str, replica: int = 0) -> None:
        """The replica's slots were emptied: no session's KV cache is there any more (its RAM cache may remain), nor
        on the other profiles of its server."""
        home = self.home(profile, replica)
        for _, placement in self.placements.items():
            if self.home(placement.profile, placement.replica) == home:
                self.placements.displace(placement.profile, placement.slot, keep=None, replica=placement.replica)

    # --- KV handoff -------------------------------------------------------------------------------------------

    async def hand_off(
        self, client: aiohttp.ClientSession, decision: Decision, session_id: str, to_slot: int | None
    ) -> HandoffResult:
        """Save the session's slot on the server it leaves (another profile, or another replica of this one) and
        restore it on the one it goes to (`decision.profile`, `decision.replica`), through the slot mover.

        Never raises: a failure means the new server re-prefills, which is always correct (llama-server reuses only
        the prefix of the restored cache that matches the prompt). Each step is guarded, and every way out ends in
        the same bookkeeping (`finally`) and the same event."""
        placement = self.placements.get(session_id)
        source = self.table.get(placement.profile, placement.replica) if placement is not None else None
        target = self.table.get(decision.profile, decision.replica)
        if placement is None or source is None or target is None or self.mover is None:
            return HandoffResult(False, 0, 0.0, 0.0, "nothing to hand over")
        if to_slot is None and self._books[(target.name, target.replica)].slots > 1:
            return HandoffResult(False, 0, 0.0, 0.0, f"{target.label} has several slots and this request names none")
        self._handoff_seq += 1
        name = f"{_SLOT_FILE_PREFIX}{hashlib.sha256(session_id.encode()).hexdigest()[:20]}-{self._handoff_seq}.bin"
        from_slot, into_slot = placement.slot or 0, to_slot or 0
        # Bounded: a save of N tokens takes milliseconds per thousand here; a slot that stays busy must not hold
        # the request for long (on failure it is forwarded and re-prefilled).
        timeout = aiohttp.ClientTimeout(total=_HANDOFF_BASE_TIMEOUT_S + placement.cached_tokens * 0.0005)
        try:
            # llama-server does not refuse a slot action on a busy slot: it waits for the running request, then acts
            # on whatever that slot holds by then. So only idle slots are touched (this request is not sent yet).
            if self.slot_busy(source.name, placement.slot, mine=0, replica=source.replica):
                raise SlotError(f"{source.label} slot {from_slot} is busy with another request")
            if self.slot_busy(target.name, to_slot, mine=1, replica=target.replica):
                raise SlotError(f"{target.label} slot {into_slot} is busy with another request")
            moved = await self.mover.move(
                client, source, from_slot, target, into_slot, name, timeout, int(0.9 * placement.cached_tokens)
            )
        except (aiohttp.ClientError, TimeoutError, ValueError, TypeError, SlotError) as exc:
            self.handoffs["failed"] += 1
            result = HandoffResult(False, placement.cached_tokens, 0.0, 0.0, str(exc) or type(exc).__name__)
        else:
            self.handoffs["ok"] += 1
            result = HandoffResult(
                True, moved.n_saved, moved.save_s, moved.restore_s, transfer_s=moved.transfer_s, bytes=moved.bytes
            )
            self.speeds.observe_handoff(moved.n_saved, moved.save_s, moved.restore_s)
            if moved.bytes:
                self.speeds.observe_transfer(moved.n_saved, moved.bytes, moved.transfer_s)
        finally:
            # The target slot was overwritten (or half so) whatever the outcome; the file goes now, and once more
            # later in case llama-server was still writing it when we gave up waiting (sweep_slot_files).
            self.placements.displace(decision.profile, to_slot, keep=session_id, replica=decision.replica)
            await self.mover.discard(name)
        self.publish(
            HandoffDone(
                session_id=session_id,
                from_profile=source.name,
                to_profile=target.name,
                ok=result.ok,
                tokens=result.tokens,
                save_s=round(result.save_s, 4),
                restore_s=round(result.restore_s, 4),
                error=result.error,
                from_replica=source.replica,
                to_replica=target.replica,
            )
        )
        return result

    def sweep_slot_files(self) -> int:
        """Delete slot files of handoffs that were given up while llama-server still wrote them (file I/O: off the
        event loop). Returns how many went."""
        if self.slot_dir is None:
            return 0
        now, gone = time.time(), 0
        for path in self.slot_dir.glob(f"{_SLOT_FILE_PREFIX}*.bin"):
            try:
                if now - path.stat().st_mtime > _STALE_SLOT_FILE_S:
                    path.unlink()
                    gone += 1
            except OSError:
                continue
        return gone

    # --- policy files -----------------------------------------------------------------------------------------

    def refresh_policies(self) -> list[str]:
        """Re-read changed policy files (file I/O: call it off the event loop); returns what changed (the store has
        already said it on the console). The speed model's priors follow the base policy (a project's own file
        changes its routing, not the shared measurements)."""
        messages = self.policies.refresh()
        if messages:
            base = self.policies.policy_for("default", None)
            self.speeds.set_policy(base.estimator, base.handoff)
        return messages

    def announce(self, messages: list[str]) -> None:
        """Publish policy changes on the live feed (on the event loop: the bus is not thread-safe)."""
        for message in messages:
            self.publish(PolicyChanged(message=message))
