"""The router: which profile, replica and slot serve a request, and the KV moves that go with it.

The shell drives it through two calls, neither of which waits: `route()` (what to do with this request: profile,
replica, slot, the KV move it asks for — a handoff, a head restore or a remote prefill — and the reason) and
`complete()` (what happened: the load comes down, it learns from llama-server's timings). Between them the shell carries
the asked move out (`requests/carry_out.py`) and reports it with `moved()` (`routing/move_planner.py` plans and learns;
where a request completes, its `plan_save` decides the head save the store carries out); everything else is pure
state: the learned speeds, where sessions' KV caches live, each server's slots and load (`routing/load.py`), what
each server holds of prompts beyond a session's own state (`routing/prompt/held.py`), the pins. `choose()` is the
decision alone, without side effects: its stages decided apart (`decide()` the profile, the prompt's new tokens,
`session_cap()` the draft cap, `MovePlanner.replica_part` the replica and whether the KV follows it) and composed once
(`routing/decision.py`)."""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import replace

from adaptive_spec.common.lru import LRU
from adaptive_spec.kv.heads.values import Restored
from adaptive_spec.kv.moves import HandoffResult, HeadRestore, PrefillAsk, RemotePrefillResult, SlotMove
from adaptive_spec.policy.model import Policy
from adaptive_spec.routing.contract import (
    Completion,
    Effects,
    NoEffects,
    PolicySource,
    ProfileHealth,
    Refusal,
    Route,
    RouteRequest,
)
from adaptive_spec.routing.decide import decide
from adaptive_spec.routing.decision import Decision, PromptPart, compose
from adaptive_spec.routing.draft_length import session_cap
from adaptive_spec.routing.estimate import ProfileState, RequestState, SessionState
from adaptive_spec.routing.load import ServerBooks
from adaptive_spec.routing.move_planner import MovePlanner
from adaptive_spec.routing.placements import Placement, Placements, observe
from adaptive_spec.routing.prompt import prefix
from adaptive_spec.routing.prompt.first_turn import pasted_file_chars, text_kind
from adaptive_spec.routing.prompt.held import HeldPrompts
from adaptive_spec.routing.prompt.pieces import Piece, lacks_system
from adaptive_spec.routing.replicas import ReplicaState
from adaptive_spec.routing.speeds import SpeedModel
from adaptive_spec.telemetry.events import PolicyChanged

MAX_PINS = 4096


class Router:
    def __init__(
        self,
        health: ProfileHealth,
        policies: PolicySource,
        slots: Mapping[str, int],
        spec_types: Mapping[str, tuple[str, ...] | None],
        effects: Effects | None = None,
        seed: int | None = None,
        replica_slots: Mapping[tuple[str, int], int] | None = None,
        servers: Mapping[tuple[str, int], str] | None = None,
        draft_caps: Mapping[str, int] | None = None,
    ) -> None:
        """`slots`: each profile's slots per server; `replica_slots` overrides it for a (profile, replica).
        `servers`: the server a (profile, replica) shares with others (profiles as per-request settings of one
        llama-server): those share its slots, its load and its sessions' KV; one not named has a server of its own.
        `effects`: which KV moves can be made, and where events go (none by default: no move is ever asked for).
        `draft_caps`: the profiles whose draft length the router may cap per request (a sequential model drafter
        alone, on a server that takes `speculative.n_max`), each with the longest cap it may choose."""
        self.health, self.policies = health, policies
        self.effects: Effects = effects or NoEffects()
        self._spec_types = dict(spec_types)
        self._draft_caps = dict(draft_caps or {})
        base = policies.policy_for("default", None)
        self.speeds = SpeedModel(base.estimator, base.handoff, {n: spec_types.get(n) for n in health.names()})
        self.load = ServerBooks(health, slots, replica_slots, servers)
        self.placements = Placements(home=self.load.home)
        self.planner = MovePlanner(self.effects, self.load, self.placements, self.speeds)
        self._rng = random.Random(seed)
        self.pins: LRU[str, str] = LRU(MAX_PINS)  # session -> profile, until unpinned (sticky, unlike the header)
        self.prefixes = prefix.PrefixTable()  # what each session's slot holds: its new-token estimates
        self.chars_per_token = prefix.DEFAULT_CHARS_PER_TOKEN  # the latest measured rate, for first turns
        # The tokens the default profile's chat template writes ahead of a prompt with no system message (its own
        # default system prompt), measured on the server at start (`template_opened`); 0 until then.
        self.template_opening = 0.0
        self.held = HeldPrompts()  # what each slot served last, sessions' side lines, each server's RAM cache

    # --- what the views and the control endpoints read ------------------------------------------------------

    def home(self, profile: str, replica: int = 0) -> tuple[str, int]:
        return self.load.home(profile, replica)

    def slot_count(self, profile: str, replica: int = 0) -> int:
        return self.load.slot_count(profile, replica)

    def server_busy(self, profile: str, replica: int = 0) -> int:
        return self.load.server_busy(profile, replica)

    def replica_states(self, profile: str, count_sessions: bool = False) -> list[ReplicaState]:
        return self.load.replica_states(profile, self.placements, count_sessions)

    def replica_counts(self, profile: str, replica: int) -> dict[str, int]:
        return dict(self.load.replica_counts.get((profile, replica), {}))

    def slots_erased(self, profile: str, replica: int = 0) -> None:
        """The replica's slots were emptied: no session's KV cache is there any more (its RAM cache may remain), nor
        on the other profiles of its server."""
        home = self.home(profile, replica)
        for _, placement in self.placements.items():
            if self.home(placement.profile, placement.replica) == home:
                self.placements.displace(
                    placement.profile, placement.slot, keep=None, replica=placement.replica, overwritten=True
                )
        self.held.erased(home)  # what each slot served last: gone

    def states(self, replicas_of: Mapping[str, list[ReplicaState]] | None = None) -> list[ProfileState]:
        """Each profile as decide() sees it (`ServerBooks.profile_states`). `replicas_of`: each profile's
        `replica_states`, when the caller has them already."""
        replicas = replicas_of or {n: self.replica_states(n) for n in self.health.names()}
        return self.load.profile_states(replicas, self.speeds.speculates, self.planner.can_save, self._spec_types)

    # --- the decision -----------------------------------------------------------------------------------------

    def choose(self, request: RouteRequest) -> tuple[Decision, Policy]:
        """The decision alone: what `route()` would decide now, with nothing counted in the load and no KV moved.
        (The pieces it reads are remembered, as for any request: a memo of the texts, not state a decision uses.)"""
        decision, policy, *_ = self._plan(request)
        return decision, policy

    def _plan(self, request: RouteRequest) -> tuple[Decision, Policy, tuple[Piece, ...], bool, float, float]:
        """The decision, the prompt's pieces as the session's prefix state sees them, and the characters per token
        and template opening the estimate took."""
        body, body_bytes, session_id, pinned = request.body, request.body_bytes, request.session_id, request.pinned
        policy = (
            request.policy
            if request.policy is not None
            else self.policies.policy_for(request.project, request.workspace)
        )
        pinned_by = "the request header"
        if pinned is None and session_id is not None and (pin := self.pins.get(session_id)) is not None:
            pinned, pinned_by = pin, "the session's pin"
        pasted = pasted_file_chars(body, policy.first_turn)
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or body.get("max_output_tokens")
        has_tools = bool(body.get("tools"))
        state = self.prefixes.get(session_id)
        # Only texts never seen before (in any session) are hashed; the session's last messages are not read again.
        pieces = self.prefixes.pieces(body, state, session_id, body_bytes)
        placement = self.placements.get(session_id)
        # A rate counted for this prompt (a first turn, or one far larger than any the session measured) comes first.
        cpt = request.chars_per_token or (state.chars_per_token if state is not None else self.chars_per_token)
        opening = self.template_opening if lacks_system(body) else 0.0
        total = prefix.total_tokens(pieces, cpt, opening)  # read once, for the session's state and each server's slot
        est = prefix.estimate(state, pieces, has_tools, cpt, total=total, opening=opening)
        own = est.shared_tokens  # against the session's own state alone (no slot given): what its KV holds
        # A side line's last request, or the main line's own prompt under a system prompt it left for a while (a
        # compaction request with the line's tools is the line going on): llama-server's RAM cache holds either.
        line = prefix.line_of(pieces)
        side = self.held.side(session_id, line)
        shared_on, best = {}, (own, state)
        names = self.health.names()
        replicas_of = {name: self.replica_states(name) for name in names}  # the load does not change while planning

        # The session's own state was just compared: nothing more to read for it.
        def measure(other: prefix.PrefixState | None) -> int:
            return own if other is state else prefix.shared_tokens(other, pieces, cpt, total, opening)

        for name in names:
            replica = self.load.preview_replica(name, placement, replicas_of[name])
            kept = placement is not None and not placement.overwritten  # else nothing of its KV is left
            shared_on[name] = own if kept and self.load.holds(name, placement) == replica else 0
            slot = self.load.slot_key(name, session_id, replica)
            for shared, other in self.held.loadable(self.home(name, replica), slot, line, side, state, measure):
                shared_on[name] = max(shared_on[name], shared)
                best = max(best, (shared, other), key=lambda b: b[0])
        if best[1] is not state:  # the prompt's tokens on the scale of what a server holds of it, so its new ones
            est = prefix.estimate(state, pieces, has_tools, cpt, best[1], total, opening)
        state_of_request = RequestState(
            body_bytes=body_bytes,
            max_tokens=max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else None,
            copy_hint=pasted > 0,
            hint_output_tokens=self.speeds.prompt_tokens(pasted),
            pinned=pinned,
            pinned_by=pinned_by,
            explore_draw=self._rng.random(),
            prompt_tokens=est.total_tokens,
            shared_tokens=own if state is not None and placement is not None else None,
            shared_on=shared_on,
            # The drafter's prior by kind of text: read only where a profile drafts with a model.
            text_kind=(
                text_kind(body, pasted > 0, request.copy_share)
                if any(self.speeds.has_drafter(n) for n in names)
                else "code"
            ),
        )
        busy = self.load.sessions_in_flight.get(session_id) if session_id is not None else None
        same = frozenset(
            n
            for n in names
            if placement is not None and n != placement.profile and self.load.holds(n, placement) is not None
        )
        session = SessionState(
            session_id,
            request.session_turns,
            request.copy_share,
            placement,
            in_flight_on=busy[0] if busy is not None else None,
            same_server=same,
            handoff_reuse=self.planner.reuse_from(placement.profile) if placement is not None else {},
        )
        choice = decide(state_of_request, session, self.states(replicas_of), self.speeds, policy)
        chosen = next((e for e in choice.estimates if e.profile == choice.profile), None)
        here = placement is None or (
            not placement.overwritten and (placement.profile == choice.profile or choice.profile in same)
        )
        prompt = PromptPart(
            new_tokens=chosen.prefill_tokens if chosen is not None else (est.new_tokens if here else est.total_tokens),
            side=est.side,
            line_moved=state is not None and est.line_moved,
        )
        decision = compose(
            choice,
            prompt,
            session_cap(self._draft_caps.get(choice.profile), placement, policy),
            self.planner.replica_part(
                choice,
                prompt,
                placement,
                policy,
                est.total_tokens,
                replicas_of[choice.profile],
                self.load.holds_up(placement),
            ),
        )
        return decision, policy, pieces, has_tools, cpt, opening

    def measured_chars(self, session_id: str | None) -> int:
        """The characters of the session's last served prompt, on which its rate was measured (0: none yet)."""
        state = self.prefixes.get(session_id)
        return sum(p.chars for p in state.pieces) if state is not None else 0

    def template_opened(self, tokens: float) -> None:
        """The default profile's chat template writes `tokens` ahead of a prompt with no system message of its own
        (measured at start: `llama/template_opening.py`)."""
        self.template_opening = max(0.0, tokens)

    # --- the two calls ----------------------------------------------------------------------------------------

    def route(self, request: RouteRequest) -> Route | Refusal:
        """Decide the request's profile, replica and slot, count it in their load, and say which KV move it asks for
        (`Route.move`): a handoff when it moves, else a stored head's restore when the store showed one that pays
        (`RouteRequest.heads`: the estimate counts it), else a remote prefill when that may be faster. Nothing is
        waited for here: the request path carries the move out (`requests/carry_out.py`) and reports it with
        `moved()`. Every route is completed once."""
        decision, _, pieces, has_tools, cpt, opening = self._plan(request)
        profile, replica = decision.profile, decision.replica
        health = self.health.replica_health(profile)
        if replica < len(health) and health[replica][1] is not None:
            url, reason = health[replica]
            return Refusal(503, f"profile {profile!r} at {url} is down: {reason}", "profile_unavailable", decision)
        if request.client_slot is not None:
            slot: int | None = request.client_slot  # the client chose; the router follows it
        else:
            side = decision.side
            slot = self.load.slot_for(profile, request.session_id, replica, side) if request.takes_slot else None
        self.load.started(profile, slot, request.session_id, replica)
        route = Route(
            decision,
            slot,
            request.session_id,
            request.body_bytes,
            pieces=pieces,
            has_tools=has_tools,
            chars_per_token=cpt,
            opening=opening,
        )
        if decision.handoff and request.session_id is not None:
            asked = self.planner.plan_handoff(decision, request.session_id, slot)
            if isinstance(asked, SlotMove):
                return replace(route, move=asked)
            return replace(route, handoff=asked)
        warm = self.planner.plan_restore(route, request)
        if warm is not None:
            return warm
        costs = self.effects.prefills_elsewhere
        if request.prefill_path is not None and costs is not None:
            return self.planner.plan_prefill(route, request, costs)
        return route

    def moved(self, route: Route, result: HandoffResult | Restored | RemotePrefillResult | None) -> Route:
        """The move the route asked for was carried out: learn what it did; the route comes back with its result (a
        head restore's None: not restored)."""
        move = route.move
        overwrote = isinstance(move, SlotMove) or result is not None
        if isinstance(result, Restored) and result.at_start:
            overwrote = False  # held since the server started: nothing was restored
        if overwrote and move is not None:
            at = move.target if isinstance(move, SlotMove) else move.at
            several = self.load.slot_count(at.profile, at.replica) > 1
            self.held.overwritten(self.home(at.profile, at.replica), at.slot if several else None)
        if isinstance(move, SlotMove) and isinstance(result, HandoffResult):
            return replace(route, handoff=self.planner.handed_off(move, result))
        if isinstance(move, HeadRestore) and (result is None or isinstance(result, Restored)):
            return self.planner.restored(route, result)
        if isinstance(move, PrefillAsk) and (result is None or isinstance(result, RemotePrefillResult)):
            return self.planner.prefilled(route, result)
        raise TypeError(f"a {type(result).__name__} does not answer {type(move).__name__}")

    def complete(self, route: Route, done: Completion) -> bool:
        """The routed request ended: its load comes down; served in full, the speeds, the session's placement and
        its prefix state learn from llama-server's timings. Returns whether this request started its session's main
        line (the requests before it were side ones)."""
        decision, slot, session_id = route.decision, route.slot, route.session_id
        profile, replica = decision.profile, decision.replica
        self.load.ended(profile, slot, session_id, replica)
        timings = done.timings
        if not done.ok or timings is None:
            return False
        self.load.count(profile, replica, timings)
        self.planner.observe_reuse(route, timings)
        before = self.placements.get(session_id) if not decision.side else None
        observe(
            self.speeds,
            self.placements,
            profile,
            slot,
            None if decision.side and slot is not None else session_id,  # a side slot is not the session's
            decision.copy_share,
            timings,
            route.body_bytes,
            replica,
        )
        if not route.pieces:
            return False
        own = self.prefixes.get(session_id)
        state = prefix.observe(
            own,
            route.pieces,
            route.has_tools,
            done.reply,
            timings,
            self.chars_per_token,
            reply_kept=done.reply_kept,
            opening=route.opening,
        )
        # Where the session's line was before, unless a slot action overwrote it: llama-server's RAM cache keeps it.
        left = None
        if before is not None and not before.overwritten and own is not None:
            left = (self.home(before.profile, before.replica), own)
        several = self.load.slot_count(profile, replica) > 1
        self.held.served(self.home(profile, replica), slot if several else None, state, session_id, decision.side, left)
        if session_id is not None and not decision.side:
            # A side request leaves the main line's state: llama-server keeps the line's prompt in its RAM cache.
            self.prefixes.put(session_id, state)
            self.chars_per_token = state.chars_per_token
        # Known only now when the earlier request was still in flight at this one's start (opencode's title).
        return decision.line_moved or (own is not None and own.line is not None and state.line != own.line)

    # --- what other proxies share (read by the shell before `route()`, written after `complete()`) -------------

    def withdraw(self, route: Route) -> None:
        """A route never forwarded (another proxy booked its slot first): its load comes down, and the slot it gave
        its session is neither counted as used nor the session's: routed again, it chooses afresh."""
        decision = route.decision
        self.load.ended(decision.profile, route.slot, route.session_id, decision.replica, used=False)

    def waits(self, route: Route) -> bool:
        """Whether the route's slot was taken when it was routed (every slot was: it waits its turn there), by this
        proxy's other requests or by those other proxies booked, as last read."""
        decision = route.decision
        return self.load.slot_busy(decision.profile, route.slot, mine=1, replica=decision.replica)

    def server_url(self, profile: str, replica: int = 0) -> str:
        """The base URL of the server (profile, replica) runs on: the name proxies that share state give it."""
        return self.load.server_url(profile, replica)

    def adopt(
        self,
        session_id: str | None,
        placement: Placement | None,
        booked: Mapping[str, Mapping[int, int]],
        occupants: Mapping[str, Mapping[int, str]] | None = None,
    ) -> None:
        """What the other proxies said just before this request is routed (`ServerBooks.adopt`): where the session's
        KV lives, the requests they have booked on each server, and which session each slot holds."""
        self.load.adopt(self.placements, session_id, placement, booked, occupants)

    # --- pins and policy files ------------------------------------------------------------------------------

    def pin(self, session_id: str, profile: str | None) -> None:
        """Keep the session's requests on `profile` (its KV follows on the next turn); None: automatic again."""
        if profile is None:
            self.pins.pop(session_id)
        else:
            self.pins.put(session_id, profile)

    def policies_changed(self, messages: list[str]) -> None:
        """The policy files were looked at again (`policies.refresh()`, file I/O the proxy runs in a thread); on the
        event loop, the speed model's priors follow the base policy (a project's own file changes its routing, not
        the shared measurements), and the changes are published on the live feed (the bus is not thread-safe)."""
        if not messages:
            return
        base = self.policies.policy_for("default", None)
        self.speeds.set_policy(base.estimator, base.handoff)
        for message in messages:
            self.effects.publish(PolicyChanged(message=message))
