"""The router's state, pure: the learned speeds, where sessions' KV caches live and which slot each holds, the load
of each profile, the recent decisions. `choose()` runs `decide()` on them; `started()` and `finished()` keep the load
and learn from each served request (through `observe()`). The proxy's shell (`proxy/routing.py`) adds the I/O: slot
save/restore, the slot-file sweep, policy reload."""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Any, Protocol

from adaptive_spec.core.lru import LRU
from adaptive_spec.core.profiles import uses_draft_model
from adaptive_spec.core.records import Timings
from adaptive_spec.core.routing.copy_hint import pasted_file_chars
from adaptive_spec.core.routing.decide import Decision, ProfileState, RequestState, SessionState, decide
from adaptive_spec.core.routing.placements import Placements, SlotBook, observe
from adaptive_spec.core.routing.policy import Policy
from adaptive_spec.core.routing.speeds import SpeedModel
from adaptive_spec.core.sessions import prefix

MAX_PINS = 4096


class ProfileHealth(Protocol):
    """The profiles by name and whether each is down (the proxy's upstream table)."""

    def names(self) -> list[str]: ...

    def down_reason(self, name: str) -> str | None: ...


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


class RouterState:
    def __init__(
        self,
        health: ProfileHealth,
        policies: PolicySource,
        slots: Mapping[str, int],
        spec_types: Mapping[str, tuple[str, ...] | None],
        seed: int | None = None,
    ) -> None:
        self.health, self.policies = health, policies
        self._spec_types = dict(spec_types)
        base = policies.policy_for("default", None)
        self.speeds = SpeedModel(base.estimator, base.handoff, {n: spec_types.get(n) for n in health.names()})
        self.placements = Placements()
        self.in_flight: dict[str, int] = dict.fromkeys(health.names(), 0)
        self._books = {n: SlotBook(max(1, slots.get(n, 1))) for n in health.names()}
        self._rng = random.Random(seed)
        self.recent: deque[dict[str, Any]] = deque(maxlen=200)
        self.handoffs = {"ok": 0, "failed": 0}
        self.pins: LRU[str, str] = LRU(MAX_PINS)  # session -> profile, until unpinned (sticky, unlike the header)
        self.prefixes = prefix.PrefixTable()  # what each session's slot holds: its new-token estimates
        self.chars_per_token = prefix.DEFAULT_CHARS_PER_TOKEN  # the latest measured rate, for first turns
        self.sessions_in_flight: dict[str, tuple[str, int]] = {}  # session -> (profile, requests being served)
        # What each slot served last, whichever session: a new session of the same agent shares its system prompt.
        self.slot_prefixes: LRU[tuple[str, int | None], prefix.PrefixState] = LRU(4096)

    def states(self) -> list[ProfileState]:
        return [
            ProfileState(
                name=n,
                down_reason=self.health.down_reason(n),
                in_flight=self.in_flight.get(n, 0),
                slots=self._books[n].slots,
                handoff=self._can_save(n),
                draft_model=uses_draft_model(self._spec_types.get(n)),
            )
            for n in self.health.names()
        ]

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
        """`pinned` is the request header's profile; without one, the session's pin (if any) applies."""
        policy = self.policies.policy_for(project, workspace)
        pinned_by = "the request header"
        if pinned is None and session_id is not None and (pin := self.pins.get(session_id)) is not None:
            pinned, pinned_by = pin, "the session's pin"
        pasted = pasted_file_chars(body, policy.first_turn)
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or body.get("max_output_tokens")
        request = RequestState(
            body_bytes=body_bytes,
            max_tokens=max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else None,
            copy_hint=pasted > 0,
            hint_output_tokens=self.speeds.prompt_tokens(pasted),
            pinned=pinned,
            pinned_by=pinned_by,
            explore_draw=self._rng.random(),
        )
        has_tools = bool(body.get("tools"))
        state = self.prefixes.get(session_id)
        pieces = prefix.prompt_pieces(body, state.pieces if state is not None else ())  # only new messages hashed
        placement = self.placements.get(session_id)
        est = prefix.estimate(state, pieces, has_tools, self.chars_per_token)
        cpt = state.chars_per_token if state is not None else self.chars_per_token
        own = prefix.shared_tokens(state, pieces, cpt)
        shared_on = {}
        for name in self.health.names():
            held = self.slot_prefixes.get((name, self._slot_key(name, session_id)))
            mine = own if placement is not None and placement.profile == name else 0
            shared_on[name] = max(mine, prefix.shared_tokens(held, pieces, cpt))
        request = replace(
            request,
            prompt_tokens=est.total_tokens,
            shared_tokens=own if state is not None and placement is not None else None,
            shared_on=shared_on,
        )
        busy = self.sessions_in_flight.get(session_id) if session_id is not None else None
        session = SessionState(
            session_id, session_turns, copy_share, placement, in_flight_on=busy[0] if busy is not None else None
        )
        decision = decide(request, session, self.states(), self.speeds, policy)
        chosen = next((e for e in decision.estimates if e.profile == decision.profile), None)
        here = placement is None or placement.profile == decision.profile
        decision = replace(
            decision,
            pieces=pieces,
            has_tools=has_tools,
            new_tokens=chosen.prefill_tokens if chosen is not None else (est.new_tokens if here else est.total_tokens),
            side=est.side,
            line_moved=state is not None and est.line_moved,
        )
        return decision, policy

    def _slot_key(self, profile: str, session_id: str | None) -> int | None:
        book = self._books[profile]
        return book.by_session.get(session_id) if book.slots > 1 and session_id is not None else None

    def slot_busy(self, profile: str, slot: int | None, mine: int) -> bool:
        """Whether requests other than `mine` (0 or 1: this request's own, counted already) occupy the slot."""
        book = self._books[profile]
        if book.slots > 1 and slot is not None:
            return book.busy.get(slot, 0) > mine
        return self.in_flight.get(profile, 0) > mine

    def _can_save(self, profile: str) -> bool:
        """Whether the profile's KV can be saved and restored through slot files (the shell knows its servers)."""
        return False

    def slot_for(self, profile: str, session_id: str | None) -> int | None:
        """The slot to name with `id_slot`, on profiles with several slots (None: let the server choose)."""
        book = self._books[profile]
        return book.pick(session_id) if book.slots > 1 else None

    def started(self, profile: str, slot: int | None, session_id: str | None = None) -> None:
        self.in_flight[profile] = self.in_flight.get(profile, 0) + 1
        if session_id is not None:
            _, count = self.sessions_in_flight.get(session_id, (profile, 0))
            self.sessions_in_flight[session_id] = (profile, count + 1)
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
        reply: str = "",
    ) -> bool:
        """Returns whether this request started its session's main line (the requests before it were side ones)."""
        self.in_flight[profile] = max(0, self.in_flight.get(profile, 0) - 1)
        if session_id is not None and session_id in self.sessions_in_flight:
            where, count = self.sessions_in_flight.pop(session_id)
            if count > 1:
                self.sessions_in_flight[session_id] = (where, count - 1)
        book = self._books[profile]
        if slot is not None:
            book.busy[slot] = max(0, book.busy.get(slot, 0) - 1)
            book.last_used[slot] = time.monotonic()
        if not ok or timings is None:
            return False
        observe(self.speeds, self.placements, profile, slot, session_id, decision.copy_share, timings, body_bytes)
        if not decision.pieces:
            return False
        own = self.prefixes.get(session_id)
        state = prefix.observe(own, decision.pieces, decision.has_tools, reply, timings)
        self.slot_prefixes.put((profile, slot if self._books[profile].slots > 1 else None), state)
        if session_id is not None and not decision.side:
            # A side request leaves the main line's state: llama-server keeps the line's prompt in its RAM cache.
            self.prefixes.put(session_id, state)
            self.chars_per_token = state.chars_per_token
        # Known only now when the earlier request was still in flight at this one's start (opencode's title).
        return decision.line_moved or (own is not None and own.line is not None and state.line != own.line)

    def pin(self, session_id: str, profile: str | None) -> None:
        """Keep the session's requests on `profile` (its KV follows on the next turn); None: automatic again."""
        if profile is None:
            self.pins.pop(session_id)
        else:
            self.pins.put(session_id, profile)

    def remember(self, record: dict[str, Any]) -> None:
        self.recent.append(record)

    def to_json(self) -> dict[str, Any]:
        return {
            "speeds": [asdict(s) for s in self.speeds.describe()],
            "in_flight": dict(self.in_flight),
            "handoffs": dict(self.handoffs),
            "placements": [{"session_id": sid, **asdict(p)} for sid, p in self.placements.items()[-100:]],
            "policy": self.policies.describe("default", None),
            "policy_problems": [str(p) for p in self.policies.problems()],  # every file's, the last good in force
            "recent_decisions": list(self.recent)[-50:],
            "pins": dict(self.pins.items()),
        }
