"""The router's shell: the I/O around the pure router state (`core/routing/router.py`): the KV handoff (save the
slot on the old profile, restore it on the new one), the sweep of left-over slot files, and policy reload."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from adaptive_spec.core.events import Event, HandoffDone, PolicyChanged
from adaptive_spec.core.routing.decide import Decision
from adaptive_spec.core.routing.router import PolicySource, RouterState
from adaptive_spec.proxy.upstreams import Upstream, UpstreamTable

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
    ) -> None:
        super().__init__(table, policies, slots, spec_types, seed)
        self.table, self.slot_dir, self.publish = table, slot_dir, publish
        self._handoff_seq = 0

    def _can_save(self, profile: str) -> bool:
        """Slot files need a shared directory; a router-mode preset (`URL#MODEL`) takes no slot actions."""
        upstream = self.table.get(profile)
        return self.slot_dir is not None and upstream is not None and upstream.upstream_model is None

    def can_save(self, profile: str) -> bool:
        return self._can_save(profile)

    def slot_count(self, profile: str) -> int:
        return self._books[profile].slots

    def slots_erased(self, profile: str) -> None:
        """The profile's slots were emptied: no session's KV cache is there any more (its RAM cache may remain)."""
        for _, placement in self.placements.items():
            if placement.profile == profile:
                self.placements.displace(profile, placement.slot, keep=None)

    # --- KV handoff -------------------------------------------------------------------------------------------

    async def hand_off(
        self, client: aiohttp.ClientSession, decision: Decision, session_id: str, to_slot: int | None
    ) -> HandoffResult:
        """Save the session's slot on the profile it leaves and restore it on the one it goes to.

        Never raises: a failure means the new profile re-prefills, which is always correct (llama-server reuses only
        the prefix of the restored cache that matches the prompt). One sequence on purpose (over ~50 lines): each
        step is guarded, and every way out ends in the same bookkeeping (`finally`) and the same event."""
        placement = self.placements.get(session_id)
        source = self.table.get(decision.moved_from or "")
        target = self.table.get(decision.profile)
        if placement is None or source is None or target is None or self.slot_dir is None:
            return HandoffResult(False, 0, 0.0, 0.0, "nothing to hand over")
        if to_slot is None and self._books[target.name].slots > 1:
            return HandoffResult(False, 0, 0.0, 0.0, f"{target.name} has several slots and this request names none")
        self._handoff_seq += 1
        name = f"{_SLOT_FILE_PREFIX}{hashlib.sha256(session_id.encode()).hexdigest()[:20]}-{self._handoff_seq}.bin"
        from_slot = placement.slot or 0
        into_slot = to_slot or 0
        # Bounded: a save of N tokens takes milliseconds per thousand here; a slot that stays busy must not hold
        # the request for long (on failure it is forwarded and re-prefilled).
        timeout = aiohttp.ClientTimeout(total=_HANDOFF_BASE_TIMEOUT_S + placement.cached_tokens * 0.0005)
        n_saved = 0
        t0 = t1 = time.perf_counter()
        try:
            # llama-server does not refuse a slot action on a busy slot: it waits for the running request, then acts
            # on whatever that slot holds by then. So only idle slots are touched (this request is not sent yet).
            if self.slot_busy(source.name, placement.slot, mine=0):
                raise SlotError(f"{source.name} slot {from_slot} is busy with another request")
            if self.slot_busy(target.name, to_slot, mine=1):
                raise SlotError(f"{target.name} slot {into_slot} is busy with another request")
            saved = await slot_action(client, source, from_slot, "save", name, timeout)
            t1 = time.perf_counter()
            n_saved = int(saved.get("n_saved") or 0)
            await self._check_slot_file(source.name, name, saved.get("n_written"))
            if n_saved < 0.9 * placement.cached_tokens:
                raise SlotError(
                    f"save on {source.name} slot {from_slot} wrote {n_saved} tokens, not the session's "
                    f"{placement.cached_tokens} (its slot was reused)"
                )
            if self.slot_busy(target.name, to_slot, mine=1):
                raise SlotError(f"{target.name} slot {into_slot} became busy with another request")
            restored = await slot_action(client, target, into_slot, "restore", name, timeout)
            t2 = time.perf_counter()
            if int(restored.get("n_restored") or -1) != n_saved:
                raise SlotError(f"restore on {target.name} restored {restored.get('n_restored')} of {n_saved} tokens")
        except (aiohttp.ClientError, TimeoutError, ValueError, TypeError, SlotError) as exc:
            self.handoffs["failed"] += 1
            result = HandoffResult(False, placement.cached_tokens, 0.0, 0.0, str(exc) or type(exc).__name__)
        else:
            self.handoffs["ok"] += 1
            result = HandoffResult(True, n_saved, t1 - t0, t2 - t1)
            self.speeds.observe_handoff(n_saved, t1 - t0, t2 - t1)
        finally:
            # The target slot was overwritten (or half so) whatever the outcome; the file goes now, and once more
            # later in case llama-server was still writing it when we gave up waiting (sweep_slot_files).
            self.placements.displace(decision.profile, to_slot, keep=session_id)
            await asyncio.to_thread(_unlink, self.slot_dir / name)
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
            )
        )
        return result

    async def _check_slot_file(self, profile: str, name: str, n_written: object) -> None:
        """The saved file must be whole before another server restores it: llama-server aborts (GGML_ASSERT in
        state_seq_load_file) on a slot file that is cut short, say by a full disk."""
        if not isinstance(n_written, int) or self.slot_dir is None:
            return
        size = await asyncio.to_thread(_size, self.slot_dir / name)
        if size != n_written:
            raise SlotError(
                f"the slot file {profile} saved has {size} of its {n_written} bytes (disk full?); not restoring it"
            )

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


class SlotError(Exception):
    pass


async def slot_action(
    client: aiohttp.ClientSession,
    upstream: Upstream,
    slot: int,
    action: str,
    filename: str,
    timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 - one deadline per slot action
) -> dict[str, Any]:
    url = f"{upstream.base_url}/slots/{slot}?action={action}"
    async with client.post(url, json={"filename": filename}, timeout=timeout) as resp:
        if resp.status != 200:
            text = (await resp.text())[:300]
            raise SlotError(f"{action} on {upstream.name} slot {slot}: HTTP {resp.status} {text}")
        body = await resp.json(content_type=None)
    if not isinstance(body, dict):
        raise SlotError(f"{action} on {upstream.name} slot {slot}: unexpected answer {str(body)[:200]}")
    return body


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)
