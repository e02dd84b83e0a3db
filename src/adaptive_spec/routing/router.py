"""The router's state, pure: the learned speeds, where sessions' KV caches live (profile, replica, slot), the load
of each replica, the recent decisions. `choose()` runs `decide()` for the profile, then `choose_replica()` for the
replica of it; `started()` and `finished()` keep the load and learn from each served request (through
`observe()`). The proxy's shell (`kv/handoff.py`) adds the I/O: slot save/restore, the slot-file sweep, policy
reload."""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Any, Protocol

from adaptive_spec.common.lru import LRU
from adaptive_spec.routing.copy_hint import pasted_file_chars
from adaptive_spec.routing.decide import Decision, ProfileState, RequestState, SessionState, decide
from adaptive_spec.routing.placements import Placement, Placements, SlotBook, observe
from adaptive_spec.routing.policy import Policy
from adaptive_spec.routing.replicas import MoveCosts, ReplicaChoice, ReplicaState, choose_replica, least_loaded
from adaptive_spec.routing.speeds import SpeedModel
from adaptive_spec.servers.profiles import uses_draft_model
from adaptive_spec.sessions import prefix
from adaptive_spec.telemetry.records import Timings

MAX_PINS = 4096


class ProfileHealth(Protocol):
    """The profiles by name and whether each is down (the proxy's upstream table): a profile is down when all its
    replicas are."""

    def names(self) -> list[str]: ...

    def down_reason(self, name: str) -> str | None: ...

    def replica_health(self, name: str) -> list[tuple[str, str | None]]:
        """Each replica's base URL and down reason (None: up), in replica order."""
        ...


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
        replica_slots: Mapping[tuple[str, int], int] | None = None,
        servers: Mapping[tuple[str, int], str] | None = None,
    ) -> None:
        """`slots`: each profile's slots per server; `replica_slots` overrides it for a (profile, replica).
        `servers`: the server a (profile, replica) shares with others (profiles as per-request settings of one
        llama-server): those share its slots, its load and its sessions' KV; one not named has a server of its own."""
        self.health, self.policies = health, policies
        self._spec_types = dict(spec_types)
        base = policies.policy_for("default", None)
        self.speeds = SpeedModel(base.estimator, base.handoff, {n: spec_types.get(n) for n in health.names()})
        self.in_flight: dict[str, int] = dict.fromkeys(health.names(), 0)
        per_replica, shared = replica_slots or {}, servers or {}
        first: dict[str, tuple[str, int]] = {}
        # Each (profile, replica) → the first (profile, replica) of its server: the key of the server's own state.
        self._home: dict[tuple[str, int], tuple[str, int]] = {}
        for n in health.names():
            for i in range(len(health.replica_health(n))):
                server = shared.get((n, i))
                self._home[(n, i)] = first.setdefault(server, (n, i)) if server is not None else (n, i)
        self.placements = Placements(home=self.home)
        books = {h: SlotBook(max(1, per_replica.get(h, slots.get(h[0], 1)))) for h in set(self._home.values())}
        self._books = {key: books[home] for key, home in self._home.items()}  # one book per server
        self.replica_in_flight: dict[tuple[str, int], int] = dict.fromkeys(books, 0)  # per server (its home key)
        # Per replica: requests served, output, drafted and accepted tokens (acceptance per replica, for telemetry).
        self.replica_counts: dict[tuple[str, int], dict[str, int]] = {
            k: {"requests": 0, "predicted_n": 0, "draft_n": 0, "draft_n_accepted": 0} for k in self._books
        }
        self._rng = random.Random(seed)
        self.recent: deque[dict[str, Any]] = deque(maxlen=200)
        self.handoffs = {"ok": 0, "failed": 0}
        self.pins: LRU[str, str] = LRU(MAX_PINS)  # session -> profile, until unpinned (sticky, unlike the header)
        self.prefixes = prefix.PrefixTable()  # what each session's slot holds: its new-token estimates
        self.chars_per_token = prefix.DEFAULT_CHARS_PER_TOKEN  # the latest measured rate, for first turns
        self.sessions_in_flight: dict[str, tuple[str, int]] = {}  # session -> (profile, requests being served)
        # What each slot served last, whichever session: a new session of the same agent shares its system prompt.
        self.slot_prefixes: LRU[tuple[str, int, int | None], prefix.PrefixState] = LRU(4096)

    def home(self, profile: str, replica: int = 0) -> tuple[str, int]:
        """The key of the server that (profile, replica) runs on: itself, or the first profile of a shared server."""
        return self._home.get((profile, replica), (profile, replica))

    def same_server(self, profile: str, replica: int, other: str) -> int | None:
        """The replica of profile `other` that runs on the same server as (profile, replica), or None."""
        if other == profile:
            return replica
        home = self.home(profile, replica)
        return next((i for i in range(len(self.health.replica_health(other))) if self.home(other, i) == home), None)

    def states(self) -> list[ProfileState]:
        """Each profile as decide() sees it: its healthy replicas' slots together (a pool is one bigger profile)."""
        out = []
        for n in self.health.names():
            replicas = self.replica_states(n)
            healthy = [r for r in replicas if r.down_reason is None] or replicas
            out.append(
                ProfileState(
                    name=n,
                    down_reason=self.health.down_reason(n),
                    # Its servers' load: on a server shared with other profiles, theirs counts too.
                    in_flight=sum(r.in_flight for r in replicas),
                    slots=sum(r.slots for r in healthy),
                    handoff=self._can_save(n),
                    draft_model=uses_draft_model(self._spec_types.get(n)),
                )
            )
        return out

    def replica_states(self, profile: str, count_sessions: bool = False) -> list[ReplicaState]:
        """`sessions` (placed on each replica) is counted for a pool, or when asked: a scan of the placements."""
        health = self.health.replica_health(profile)
        count_sessions = count_sessions or len(health) > 1
        states = []
        for i, (url, down) in enumerate(health):
            book = self._books.get((profile, i)) or SlotBook(1)
            in_flight = self.replica_in_flight.get(self.home(profile, i), 0)
            states.append(
                ReplicaState(
                    index=i,
                    base_url=url,
                    down_reason=down,
                    slots=book.slots,
                    # Requests without a named slot (one-slot servers, APIs that take no id_slot) occupy one too.
                    busy_slots=min(book.slots, max(sum(1 for n in book.busy.values() if n > 0), in_flight)),
                    in_flight=in_flight,
                    sessions=self.placements.count_on(profile, i) if count_sessions else 0,
                )
            )
        return states

    def _held_on(self, profile: str, placement: Placement | None) -> int | None:
        """The replica of `profile` whose server holds the session's KV (its own profile's, or one sharing it)."""
        return self.same_server(placement.profile, placement.replica, profile) if placement is not None else None

    def _preview_replica(self, profile: str, placement: Placement | None) -> int:
        """The replica a request would use before the overload check: its KV's, else the least loaded one."""
        held = self._held_on(profile, placement)
        replicas = self.replica_states(profile)
        if held is not None and held < len(replicas) and replicas[held].down_reason is None:
            return held
        best = least_loaded(replicas)
        return best.index if best is not None else 0

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
            replica = self._preview_replica(name, placement)
            held = self.slot_prefixes.get((*self.home(name, replica), self._slot_key(name, session_id, replica)))
            mine = own if self._held_on(name, placement) == replica else 0
            shared_on[name] = max(mine, prefix.shared_tokens(held, pieces, cpt))
        request = replace(
            request,
            prompt_tokens=est.total_tokens,
            shared_tokens=own if state is not None and placement is not None else None,
            shared_on=shared_on,
        )
        busy = self.sessions_in_flight.get(session_id) if session_id is not None else None
        same = frozenset(
            n
            for n in self.health.names()
            if placement is not None and n != placement.profile and self._held_on(n, placement) is not None
        )
        session = SessionState(
            session_id,
            session_turns,
            copy_share,
            placement,
            in_flight_on=busy[0] if busy is not None else None,
            same_server=same,
        )
        decision = decide(request, session, self.states(), self.speeds, policy)
        chosen = next((e for e in decision.estimates if e.profile == decision.profile), None)
        here = placement is None or placement.profile == decision.profile or decision.profile in same
        decision = replace(
            decision,
            pieces=pieces,
            has_tools=has_tools,
            new_tokens=chosen.prefill_tokens if chosen is not None else (est.new_tokens if here else est.total_tokens),
            side=est.side,
            line_moved=state is not None and est.line_moved,
        )
        return self._with_replica(decision, placement, policy, est.total_tokens), policy

    def _with_replica(
        self, decision: Decision, placement: Placement | None, policy: Policy, total_tokens: int
    ) -> Decision:
        """The replica of the decided profile (`choose_replica`), folded into the decision: a session whose replica
        is down re-prefills elsewhere; one moved off an overloaded replica takes its KV along when it can."""
        profile = decision.profile
        replicas = self.replica_states(profile)
        held = self._held_on(profile, placement)
        costs = None
        if placement is not None and held is not None:
            chosen = next((e for e in decision.estimates if e.profile == profile), None)
            idle = least_loaded([r for r in replicas if r.index != held])
            can_move = (
                idle is not None
                and policy.handoff.enabled
                and placement.in_slot
                # A busy slot cannot be saved (llama-server would save whatever it holds once the running request
                # ends): under load the session's slot is usually serving another session, and a move re-prefills.
                and not self.slot_busy(profile, placement.slot, mine=0, replica=held)
                and self._can_move(profile, held, profile, idle.index)
            )
            costs = MoveCosts(
                cached_tokens=placement.cached_tokens,
                handoff_s=(
                    self.speeds.handoff_s(placement.cached_tokens, self._transfers(profile, held, profile, idle.index))
                    if can_move and idle is not None
                    else None
                ),
                reprefill_s=self.speeds.prefill_s(profile, placement.cached_tokens),
                # A request queued ahead is taken to last about as long as this one is estimated to.
                wait_s=chosen.total_s if chosen is not None else self._turn_s(decision, placement),
            )
        choice: ReplicaChoice = choose_replica(profile, replicas, held, costs)
        changes: dict[str, Any] = {"replica": choice.replica, "replica_kind": choice.kind}
        if choice.reason:
            changes["reason"] = f"{decision.reason}; {choice.reason}"
        if choice.moved_from is not None and placement is not None:
            changes["replica_moved_from"] = choice.moved_from
            changes["handoff"] = choice.handoff
            changes["handoff_tokens"] = placement.cached_tokens if choice.handoff else 0
            if not choice.handoff:
                changes["new_tokens"] = total_tokens  # its KV is out of reach: the whole prompt is prefilled
        elif decision.handoff and placement is not None:
            # Across profiles: the KV goes from its replica (if that one is up) to the chosen one, when they can.
            source = self.health.replica_health(placement.profile)
            source_up = placement.replica < len(source) and source[placement.replica][1] is None
            changes["handoff"] = source_up and self._can_move(
                placement.profile, placement.replica, profile, choice.replica
            )
            if not changes["handoff"]:
                changes["handoff_tokens"] = 0
        return replace(decision, **changes)

    def _turn_s(self, decision: Decision, placement: Placement) -> float:
        """This turn's estimated time where the session is (a decision without estimates: pinned, forced, only)."""
        per_token = self.speeds.decode_s_per_token(decision.profile, decision.copy_share, decision.context_tokens)
        prefill = self.speeds.prefill_s(decision.profile, decision.new_tokens or 0)
        return prefill + max(1.0, placement.output_tokens) * per_token

    def _can_move(self, from_profile: str, from_replica: int, to_profile: str, to_replica: int) -> bool:
        """Whether a slot can go from one server to the other (the shell knows how: a shared slot directory, or a
        transfer between hosts)."""
        return self._can_save(from_profile) and self._can_save(to_profile)

    def _transfers(self, from_profile: str, from_replica: int, to_profile: str, to_replica: int) -> bool:
        """Whether a slot file moved between these servers crosses hosts (priced with its transfer time)."""
        return False

    def _slot_key(self, profile: str, session_id: str | None, replica: int = 0) -> int | None:
        book = self._books[(profile, replica)]
        return book.by_session.get(session_id) if book.slots > 1 and session_id is not None else None

    def slot_busy(self, profile: str, slot: int | None, mine: int, replica: int = 0) -> bool:
        """Whether requests other than `mine` (0 or 1: this request's own, counted already) occupy the slot."""
        book = self._books[(profile, replica)]
        if book.slots > 1 and slot is not None:
            return book.busy.get(slot, 0) > mine
        return self.replica_in_flight.get(self.home(profile, replica), 0) > mine

    def _can_save(self, profile: str) -> bool:
        """Whether the profile's KV can be saved and restored through slot files (the shell knows its servers)."""
        return False

    def slot_for(self, profile: str, session_id: str | None, replica: int = 0) -> int | None:
        """The slot to name with `id_slot`, on profiles with several slots (None: let the server choose)."""
        book = self._books[(profile, replica)]
        return book.pick(session_id) if book.slots > 1 else None

    def started(self, profile: str, slot: int | None, session_id: str | None = None, replica: int = 0) -> None:
        self.in_flight[profile] = self.in_flight.get(profile, 0) + 1
        key = (profile, replica)
        home = self.home(profile, replica)
        self.replica_in_flight[home] = self.replica_in_flight.get(home, 0) + 1
        if session_id is not None:
            _, count = self.sessions_in_flight.get(session_id, (profile, 0))
            self.sessions_in_flight[session_id] = (profile, count + 1)
        if slot is not None:
            book = self._books[key]
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
        replica: int = 0,
    ) -> bool:
        """Returns whether this request started its session's main line (the requests before it were side ones)."""
        self.in_flight[profile] = max(0, self.in_flight.get(profile, 0) - 1)
        key, home = (profile, replica), self.home(profile, replica)
        self.replica_in_flight[home] = max(0, self.replica_in_flight.get(home, 0) - 1)
        if session_id is not None and session_id in self.sessions_in_flight:
            where, count = self.sessions_in_flight.pop(session_id)
            if count > 1:
                self.sessions_in_flight[session_id] = (where, count - 1)
        book = self._books[key]
        if slot is not None:
            book.busy[slot] = max(0, book.busy.get(slot, 0) - 1)
            book.last_used[slot] = time.monotonic()
        if not ok or timings is None:
            return False
        counts = self.replica_counts.setdefault(key, {})
        counts["requests"] = counts.get("requests", 0) + 1
        for field in ("predicted_n", "draft_n", "draft_n_accepted"):
            counts[field] = counts.get(field, 0) + getattr(timings, field)
        observe(
            self.speeds, self.placements, profile, slot, session_id, decision.copy_share, timings, body_bytes, replica
        )
        if not decision.pieces:
            return False
        own = self.prefixes.get(session_id)
        state = prefix.observe(own, decision.pieces, decision.has_tools, reply, timings, self.chars_per_token)
        self.slot_prefixes.put((*home, slot if book.slots > 1 else None), state)
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
            "replicas": {n: [asdict(r) for r in self.replica_states(n, True)] for n in self.health.names()},
            "handoffs": dict(self.handoffs),
            # How a KV handoff between hosts is priced (the prior until a move has measured it).
            "kv_transfer": {
                "bytes_per_token": round(self.speeds.kv_bytes_per_token(), 1),
                "bandwidth_mb_per_s": round(self.speeds.bandwidth_bytes_per_s() / 1e6, 2),
            },
            "placements": [{"session_id": sid, **asdict(p)} for sid, p in self.placements.items()[-100:]],
            "policy": self.policies.describe("default", None),
            "policy_problems": [str(p) for p in self.policies.problems()],  # every file's, the last good in force
            "recent_decisions": list(self.recent)[-50:],
            "pins": dict(self.pins.items()),
        }
