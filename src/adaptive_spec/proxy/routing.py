"""The router's shell around the pure `decide`: the learned speeds, where sessions' KV caches live, the load of
each profile, the policy files, and the KV handoff (save the slot on the old profile, restore it on the new one)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from adaptive_spec.core.events import Event, HandoffDone, PolicyChanged
from adaptive_spec.core.policy import FirstTurnPolicy, Policy
from adaptive_spec.core.profiles import uses_draft_model
from adaptive_spec.core.records import Timings
from adaptive_spec.core.route import (
    Decision,
    Placements,
    ProfileState,
    RequestState,
    SessionState,
    decide,
    pasted_chars,
)
from adaptive_spec.core.sessions import message_text, messages_of
from adaptive_spec.core.speeds import SpeedModel
from adaptive_spec.proxy.upstreams import Upstream, UpstreamTable

log = logging.getLogger(__name__)
_HANDOFF_BASE_TIMEOUT_S = 10.0
_SLOT_FILE_PREFIX = "as-"
_STALE_SLOT_FILE_S = 300.0


class PolicySource(Protocol):
    def policy_for(self, project: str, workspace: str | None) -> Policy: ...

    def refresh(self) -> list[str]: ...

    def describe(self, project: str, workspace: str | None) -> dict[str, Any]: ...

    def problems(self) -> list[Any]: ...


class FixedPolicy:
    """One policy for every project (tests, and a proxy started without policy files)."""

    def __init__(self, policy: Policy | None = None) -> None:
        self.policy = policy or Policy()

    def policy_for(self, project: str, workspace: str | None) -> Policy:
        return self.policy

    def refresh(self) -> list[str]:
        return []

    def describe(self, project: str, workspace: str | None) -> dict[str, Any]:
        return {"sources": list(self.policy.sources), "problems": [], "policy": asdict(self.policy)}

    def problems(self) -> list[Any]:
        return []


@dataclass(frozen=True, slots=True)
class HandoffResult:
    ok: bool
    tokens: int
    save_s: float
    restore_s: float
    error: str | None = None


@dataclass
class _SlotBook:
    """Which slot of a several-slot profile each session uses, and which slots are busy."""

    slots: int
    by_session: dict[str, int] = field(default_factory=dict)
    busy: dict[int, int] = field(default_factory=dict)
    last_used: dict[int, float] = field(default_factory=dict)

    def pick(self, session_id: str | None) -> int:
        mine = self.by_session.get(session_id) if session_id is not None else None
        if mine is not None and not self.busy.get(mine):
            return mine
        free = [s for s in range(self.slots) if not self.busy.get(s)] or list(range(self.slots))
        slot = min(free, key=lambda s: self.last_used.get(s, 0.0))
        if session_id is not None:
            self.by_session[session_id] = slot
            if len(self.by_session) > 10_000:
                self.by_session.pop(next(iter(self.by_session)))
        return slot


_HINT_MESSAGES = 12  # how far back a pasted file is looked for


def copy_hint(body: Mapping[str, Any], policy: FirstTurnPolicy) -> int:
    """Chars of the pasted file the last user message asks for back whole, 0 when it does not (`pasted_chars`)."""
    messages = messages_of(body)[-_HINT_MESSAGES:]
    last = next((i for i in range(len(messages) - 1, -1, -1) if messages[i].get("role") == "user"), None)
    if last is None:
        prompt = body.get("prompt")
        return pasted_chars(prompt[-4000:], policy, (prompt,)) if isinstance(prompt, str) else 0
    earlier = [message_text(m.get("content")) for m in messages[:last]]
    return pasted_chars(message_text(messages[last].get("content")), policy, earlier)


class Router:
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
        self.table, self.policies, self.slot_dir, self.publish = table, policies, slot_dir, publish
        self._spec_types = dict(spec_types)
        base = policies.policy_for("default", None)
        self.speeds = SpeedModel(base.estimator, base.handoff, {n: spec_types.get(n) for n in table.names()})
        self.placements = Placements()
        self.in_flight: dict[str, int] = dict.fromkeys(table.names(), 0)
        self._books = {n: _SlotBook(max(1, slots.get(n, 1))) for n in table.names()}
        self._rng = random.Random(seed)
        self.recent: deque[dict[str, Any]] = deque(maxlen=200)
        self.handoffs = {"ok": 0, "failed": 0}
        self._handoff_seq = 0

    # --- deciding ---------------------------------------------------------------------------------------------

    def states(self) -> list[ProfileState]:
        return [
            ProfileState(name=n, down_reason=self.table.down_reason(n), in_flight=self.in_flight.get(n, 0),
                         slots=self._books[n].slots, handoff=self._can_save(n),
                         draft_model=uses_draft_model(self._spec_types.get(n)))
            for n in self.table.names()
        ]  # fmt: skip

    def choose(
        self,
        *,
        body: Mapping[str, Any],
        body_bytes: int,
        session_id: str | None,
        session_turns: int,
        copy_share: float | None,
        project: str,
        workspace: str | None,
        pinned: str | None,
    ) -> tuple[Decision, Policy]:
        policy = self.policies.policy_for(project, workspace)
        pasted = copy_hint(body, policy.first_turn)
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or body.get("max_output_tokens")
        request = RequestState(
            body_bytes=body_bytes, max_tokens=max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else None,
            copy_hint=pasted > 0, hint_output_tokens=self.speeds.prompt_tokens(pasted), pinned=pinned,
            explore_draw=self._rng.random(),
        )  # fmt: skip
        session = SessionState(session_id, session_turns, copy_share, self.placements.get(session_id))
        decision = decide(request, session, self.states(), self.speeds, policy)
        return decision, policy

    def _slot_busy(self, profile: str, slot: int | None, mine: int) -> bool:
        """Whether requests other than `mine` (0 or 1: this request's own, counted already) occupy the slot."""
        book = self._books[profile]
        if book.slots > 1 and slot is not None:
            return book.busy.get(slot, 0) > mine
        return self.in_flight.get(profile, 0) > mine

    def _can_save(self, profile: str) -> bool:
        """Slot files need a shared directory; a router-mode preset (`URL#MODEL`) takes no slot actions."""
        upstream = self.table.get(profile)
        return self.slot_dir is not None and upstream is not None and upstream.upstream_model is None

    def slot_for(self, profile: str, session_id: str | None) -> int | None:
        """The slot to name with `id_slot`, on profiles with several slots (None: let the server choose)."""
        book = self._books[profile]
        return book.pick(session_id) if book.slots > 1 else None

    def started(self, profile: str, slot: int | None) -> None:
        self.in_flight[profile] = self.in_flight.get(profile, 0) + 1
        if slot is not None:
            book = self._books[profile]
            book.busy[slot] = book.busy.get(slot, 0) + 1

    def finished(
        self,
        decision: Decision,
        profile: str,
        slot: int | None,
        session_id: str | None,
        timings: Timings | None,
        body_bytes: int,
        ok: bool,
    ) -> None:
        self.in_flight[profile] = max(0, self.in_flight.get(profile, 0) - 1)
        book = self._books[profile]
        if slot is not None:
            book.busy[slot] = max(0, book.busy.get(slot, 0) - 1)
            book.last_used[slot] = time.monotonic()
        if not ok or timings is None:
            return
        self.speeds.observe(profile, decision.copy_share, timings, body_bytes)
        if session_id is not None:
            self.placements.displace(profile, slot, keep=session_id)
            cached = timings.cache_n + timings.prompt_n + timings.predicted_n
            self.placements.served(session_id, profile, slot, cached, timings.predicted_n)

    def slot_count(self, profile: str) -> int:
        return self._books[profile].slots

    def slots_erased(self, profile: str) -> None:
        """The profile's slots were emptied: no session's KV cache is there any more (its RAM cache may remain)."""
        for _, placement in self.placements.items():
            if placement.profile == profile:
                self.placements.displace(profile, placement.slot, keep=None)

    def remember(self, record: dict[str, Any]) -> None:
        self.recent.append(record)

    # --- KV handoff -------------------------------------------------------------------------------------------

    async def hand_off(
        self, client: aiohttp.ClientSession, decision: Decision, session_id: str, to_slot: int | None
    ) -> HandoffResult:
        """Save the session's slot on the profile it leaves and restore it on the one it goes to.

        Never raises: a failure means the new profile re-prefills, which is always correct (llama-server reuses only
        the prefix of the restored cache that matches the prompt)."""
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
            if self._slot_busy(source.name, placement.slot, mine=0):
                raise _SlotError(f"{source.name} slot {from_slot} is busy with another request")
            if self._slot_busy(target.name, to_slot, mine=1):
                raise _SlotError(f"{target.name} slot {into_slot} is busy with another request")
            saved = await _slot_action(client, source, from_slot, "save", name, timeout)
            t1 = time.perf_counter()
            n_saved = int(saved.get("n_saved") or 0)
            if n_saved < 0.9 * placement.cached_tokens:
                raise _SlotError(f"save on {source.name} slot {from_slot} wrote {n_saved} tokens, not the session's "
                                 f"{placement.cached_tokens} (its slot was reused)")  # fmt: skip
            if self._slot_busy(target.name, to_slot, mine=1):
                raise _SlotError(f"{target.name} slot {into_slot} became busy with another request")
            restored = await _slot_action(client, target, into_slot, "restore", name, timeout)
            t2 = time.perf_counter()
            if int(restored.get("n_restored") or -1) != n_saved:
                raise _SlotError(f"restore on {target.name} restored {restored.get('n_restored')} of {n_saved} tokens")
        except (aiohttp.ClientError, TimeoutError, ValueError, TypeError, _SlotError) as exc:
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
                session_id=session_id, from_profile=source.name, to_profile=target.name, ok=result.ok,
                tokens=result.tokens, save_s=round(result.save_s, 4), restore_s=round(result.restore_s, 4),
                error=result.error,
            )
        )  # fmt: skip
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

    def to_json(self) -> dict[str, Any]:
        return {
            "speeds": [asdict(s) for s in self.speeds.describe()],
            "in_flight": dict(self.in_flight),
            "handoffs": dict(self.handoffs),
            "placements": [{"session_id": sid, **asdict(p)} for sid, p in self.placements.items()[-100:]],
            "policy": self.policies.describe("default", None),
            "policy_problems": [str(p) for p in self.policies.problems()],  # every file's, the last good in force
            "recent_decisions": list(self.recent)[-50:],
        }


class _SlotError(Exception):
    pass


async def _slot_action(
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
            raise _SlotError(f"{action} on {upstream.name} slot {slot}: HTTP {resp.status} {text}")
        body = await resp.json(content_type=None)
    if not isinstance(body, dict):
        raise _SlotError(f"{action} on {upstream.name} slot {slot}: unexpected answer {str(body)[:200]}")
    return body


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)
