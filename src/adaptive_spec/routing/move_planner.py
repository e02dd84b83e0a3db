"""The KV moves a route asks for, planned without waiting: a session's slot handed from the server it leaves to the
one it goes to, a stored head restored into a session's first slot (`kv/heads/choice.py` chooses and prices it), or a
prompt prefilled on a faster server (`kv/remote_prefill/pricing.py` prices it); what each move did, learned once the
request path has carried it out; what handoffs were measured to reuse; and, where a request completes, the head save
it asks of the head store (`plan_save`: a first turn's head, a later turn's state once its session is idle)."""

from __future__ import annotations

from dataclasses import replace

from adaptive_spec.common.means import RunningMean
from adaptive_spec.kv.heads.choice import choose_head, tokens_after
from adaptive_spec.kv.heads.matching import inert
from adaptive_spec.kv.heads.values import Restored, SavedTurn
from adaptive_spec.kv.moves import AfterTurn, HandoffResult, HeadSave, PrefillAsk, RemotePrefillResult, SlotAt, SlotMove
from adaptive_spec.kv.remote_prefill.pricing import RemoteCosts, choose
from adaptive_spec.policy.model import Policy
from adaptive_spec.routing.contract import Effects, Route, RouteRequest, TurnEnd
from adaptive_spec.routing.decision import Choice, Decision, MovePart, PromptPart, ReplicaPart
from adaptive_spec.routing.load import ServerBooks
from adaptive_spec.routing.placements import Placement, Placements
from adaptive_spec.routing.prompt.prefix import tokens_beyond
from adaptive_spec.routing.replicas import MoveCosts, ReplicaState, choose_replica, least_loaded
from adaptive_spec.routing.speeds import SpeedModel
from adaptive_spec.telemetry.events import HandoffDone
from adaptive_spec.telemetry.records import Timings

_REUSE_PRIOR_WEIGHT = 0.5  # one handoff whose prompt reused nothing brings a pair's mean to 1/3: below min_reuse


class MovePlanner:
    def __init__(self, effects: Effects, load: ServerBooks, placements: Placements, speeds: SpeedModel) -> None:
        """The router's load, placements and speeds: a move checks the slots it touches, displaces what it
        overwrote and teaches the speeds what it cost."""
        self.effects, self.load, self.placements, self.speeds = effects, load, placements, speeds
        self.handoffs = {"ok": 0, "failed": 0}
        # (from profile, to profile) -> the share of a handoff's restored tokens the next prompt reused (cache_n),
        # a running mean that starts at 1: a restore that restored nothing (llama.cpp #26676) stops further ones.
        self.reuse: dict[tuple[str, str], RunningMean] = {}

    def can_move(self, from_profile: str, from_replica: int, to_profile: str, to_replica: int) -> bool:
        """Whether a slot can go from one server to the other (the effects know how: a shared slot directory, or a
        transfer between hosts)."""
        return self.effects.can_move(SlotAt(from_profile, from_replica, None), SlotAt(to_profile, to_replica, None))

    def transfers(self, from_profile: str, from_replica: int, to_profile: str, to_replica: int) -> bool:
        """Whether a slot file moved between these servers crosses hosts (priced with its transfer time)."""
        return self.effects.transfers(SlotAt(from_profile, from_replica, None), SlotAt(to_profile, to_replica, None))

    def can_save(self, profile: str) -> bool:
        """Whether the profile's KV can be saved and restored through slot files at all."""
        return self.can_move(profile, 0, profile, 0)

    def reuse_from(self, profile: str) -> dict[str, tuple[float, int]]:
        """Per target profile: what handoffs from `profile` to it were measured to reuse, and how many."""
        return {
            to: (mean.value(1.0), round(mean.n))
            for (source, to), mean in self.reuse.items()
            if source == profile and mean.n > 0
        }

    def observe_reuse(self, route: Route, timings: Timings) -> None:
        """After a handoff: the share of what was restored that the prompt reused (llama-server's cache_n)."""
        handoff = route.handoff
        if handoff is None or not handoff.ok or handoff.tokens <= 0 or timings.from_usage:
            return
        decision = route.decision
        pair = (decision.moved_from or decision.profile, decision.profile)
        mean = self.reuse.setdefault(pair, RunningMean(_REUSE_PRIOR_WEIGHT, self.speeds.forget))
        mean.add(min(1.0, timings.cache_n / handoff.tokens))

    def replica_part(
        self,
        choice: Choice,
        prompt: PromptPart,
        placement: Placement | None,
        policy: Policy,
        total_tokens: int,
        replicas: list[ReplicaState],
        source_up: bool,
    ) -> ReplicaPart:
        """The replica stage of a decision: the replica of the chosen profile (`choose_replica`), and whether the
        session's KV can follow it there (`source_up`: the replica holding it is up): a session whose replica is down
        re-prefills elsewhere; one moved off an overloaded replica takes its KV along when it can."""
        profile = choice.profile
        held = self.load.same_server(placement.profile, placement.replica, profile) if placement is not None else None
        costs = None
        if placement is not None and held is not None:
            costs = self._move_costs(choice, prompt, placement, policy, held, replicas)
        picked = choose_replica(profile, replicas, held, costs)
        if picked.moved_from is not None and placement is not None:
            return ReplicaPart(
                picked.replica,
                picked.kind,
                picked.reason,
                picked.moved_from,
                handoff=picked.handoff,
                handoff_tokens=placement.cached_tokens if picked.handoff else 0,
                new_tokens=None if picked.handoff else total_tokens,  # its KV is out of reach: the whole prompt
            )
        if choice.handoff and placement is not None:
            # Across profiles: the KV goes from its replica (if that one is up) to the chosen one, when they can.
            handoff = source_up and self.can_move(placement.profile, placement.replica, profile, picked.replica)
            return ReplicaPart(
                picked.replica, picked.kind, picked.reason, handoff=handoff, handoff_tokens=None if handoff else 0
            )
        return ReplicaPart(picked.replica, picked.kind, picked.reason)

    def _move_costs(
        self,
        choice: Choice,
        prompt: PromptPart,
        placement: Placement,
        policy: Policy,
        held: int,
        replicas: list[ReplicaState],
    ) -> MoveCosts:
        """What moving the session off its replica `held` would cost, against waiting there."""
        profile = choice.profile
        chosen = next((e for e in choice.estimates if e.profile == profile), None)
        idle = least_loaded([r for r in replicas if r.index != held])
        can_move = (
            idle is not None
            and policy.handoff.enabled
            and placement.in_slot
            # A busy slot cannot be saved (llama-server would save whatever it holds once the running request
            # ends): under load the session's slot is usually serving another session, and a move re-prefills.
            and not self.load.slot_busy(profile, placement.slot, mine=0, replica=held)
            and self.can_move(profile, held, profile, idle.index)
        )
        return MoveCosts(
            cached_tokens=placement.cached_tokens,
            handoff_s=(
                self.speeds.handoff_s(placement.cached_tokens, self.transfers(profile, held, profile, idle.index))
                if can_move and idle is not None
                else None
            ),
            reprefill_s=self.speeds.prefill_s(profile, placement.cached_tokens),
            # A request queued ahead is taken to last about as long as this one is estimated to.
            wait_s=chosen.total_s if chosen is not None else self._turn_s(choice, prompt, placement),
        )

    def _turn_s(self, choice: Choice, prompt: PromptPart, placement: Placement) -> float:
        """This turn's estimated time where the session is (a choice without estimates: pinned, forced, only)."""
        per_token = self.speeds.decode_s_per_token(
            choice.profile, choice.copy_share, choice.context_tokens, choice.acceptance
        )
        new = prompt.new_tokens or 0
        prefill = self.speeds.prefill_s(choice.profile, new, max(0, choice.context_tokens - new))
        return prefill + max(1.0, placement.output_tokens) * per_token

    def plan_handoff(self, decision: Decision, session_id: str, to_slot: int | None) -> SlotMove | HandoffResult | None:
        """The slot move a handoff asks for: save the session's slot on the server it leaves, restore it on the one
        it goes to. Or, where it cannot be made, its result at once (a refusal is folded in here: nothing is moved,
        the new server re-prefills, which is always correct). None: the session has no KV anywhere."""
        placement = self.placements.get(session_id)
        if placement is None:
            return None
        source = SlotAt(placement.profile, placement.replica, placement.slot)
        target = SlotAt(decision.profile, decision.replica, to_slot)
        move = SlotMove(session_id, source, target, placement.cached_tokens)
        # llama-server does not refuse a slot action on a busy slot: it waits for the running request, then acts on
        # whatever that slot holds by then. So only idle slots are touched (this request is not sent yet).
        if to_slot is None and self.load.slot_count(target.profile, target.replica) > 1:
            # Nothing can be touched, so nothing is counted or displaced.
            return HandoffResult(False, 0, 0.0, 0.0, f"{target.label} has several slots and this request names none")
        problem = None
        if self.load.slot_busy(source.profile, source.slot, mine=0, replica=source.replica):
            problem = f"{source.label} slot {source.slot or 0} is busy with another request"
        elif self.load.slot_busy(target.profile, to_slot, mine=1, replica=target.replica):
            problem = f"{target.label} slot {to_slot or 0} is busy with another request"
        if problem is not None:
            return self.handed_off(move, HandoffResult(False, placement.cached_tokens, 0.0, 0.0, problem))
        return move

    def handed_off(self, move: SlotMove, result: HandoffResult) -> HandoffResult:
        """What a handoff did, learned: every way out ends in the same bookkeeping and the same event."""
        self.handoffs["ok" if result.ok else "failed"] += 1
        if result.ok:
            self.speeds.observe_handoff(result.tokens, result.save_s, result.restore_s)
            if result.bytes:
                self.speeds.link.observe_transfer(result.tokens, result.bytes, result.transfer_s)
        # The target slot was overwritten (or half so) whatever the outcome.
        target = move.target
        self.placements.displace(
            target.profile, target.slot, keep=move.session_id, replica=target.replica, overwritten=True
        )
        self.effects.publish(
            HandoffDone(
                session_id=move.session_id,
                from_profile=move.source.profile,
                to_profile=target.profile,
                ok=result.ok,
                tokens=result.tokens,
                save_s=round(result.save_s, 4),
                restore_s=round(result.restore_s, 4),
                error=result.error,
                from_replica=move.source.replica,
                to_replica=target.replica,
            )
        )
        return result

    def plan_restore(self, route: Route, request: RouteRequest) -> Route | None:
        """The route with the head restore it asks for, when the store showed heads on its server (a session's first
        request there), the request is its session's main line and a head pays (`choose_head`); its decision's
        estimate counts the restore from the start. None: no restore."""
        decision = route.decision
        view = request.heads.get((decision.profile, decision.replica))
        if view is None or decision.side or not route.pieces:
            return None
        new_tokens = decision.new_tokens
        slot_tokens = decision.context_tokens - new_tokens if new_tokens is not None else 0
        at = SlotAt(decision.profile, decision.replica, route.slot)
        digests = [p.digest for p in route.pieces]
        move = choose_head(view, digests, request.head_blocks, at, slot_tokens, self.speeds.prefill_rate())
        if move is None:
            return None
        match = move.match
        if new_tokens is not None:
            beyond = tokens_beyond(route.pieces, match.pieces, route.chars_per_token)
            new_tokens = tokens_after(new_tokens, beyond, match, route.chars_per_token)
        tokens = max(match.tokens, match.entry.prompt_tokens)
        planned = MovePart(f"warm: head of {tokens} tokens to restore", new_tokens)
        return replace(route, decision=decision.planning(planned), move=move)

    def restored(self, route: Route, restored: Restored | None) -> Route:
        """What a head restore did: the route's decision says so (its estimate stands), or, not restored, it is the
        decision without the move."""
        decision = route.decision
        if restored is not None and not restored.at_start:
            # The restore overwrote the slot: whoever it held is gone from the server, not in its RAM cache.
            self.placements.displace(
                decision.profile, route.slot, keep=route.session_id, replica=decision.replica, overwritten=True
            )
        done = MovePart(restored.reason(), decision.new_tokens) if restored is not None else None
        return replace(route, decision=decision.carried(done), restored=restored)

    def plan_prefill(self, route: Route, request: RouteRequest, costs: RemoteCosts) -> Route:
        """The route with the remote prefill it asks for, of a prompt this server would prefill itself, when the
        remote path is faster (`choose`, priced with `costs`); otherwise the route with that verdict in its reason
        (a prompt of `min_tokens` or more), or as it was (nothing to ask)."""
        decision, slot = route.decision, route.slot
        profile, replica = decision.profile, decision.replica
        new_tokens = decision.new_tokens
        if new_tokens is None or decision.handoff or not self.can_save(profile):
            return route
        if slot is None and self.load.slot_count(profile, replica) > 1:
            return route
        local = self.speeds.prefill_rate()
        choice = choose(new_tokens, decision.context_tokens, local, costs)
        if not choice.remote:
            here = choice.reason if new_tokens >= costs.policy.min_tokens else ""
            return replace(route, decision=decision.after(MovePart(here))) if here else route
        ask = PrefillAsk(
            at=SlotAt(profile, replica, slot),
            session_id=route.session_id,
            path=request.prefill_path or "",
            body=dict(request.body),
            new_tokens=new_tokens,
            context_tokens=decision.context_tokens,
            local=local,
            slot_busy=self.load.slot_busy(profile, slot, mine=1, replica=replica),
        )
        return replace(route, decision=decision.planning(MovePart(choice.reason)), move=ask)

    def prefilled(self, route: Route, result: RemotePrefillResult | None) -> Route:
        """What a remote prefill did (None: there was no remote to ask for that server): the route comes back with
        it, its reason saying so."""
        decision = route.decision
        if result is None:
            return replace(route, decision=decision.carried(None))
        # The slot was overwritten (or half so) whatever the outcome.
        self.placements.displace(
            decision.profile, route.slot, keep=route.session_id, replica=decision.replica, overwritten=True
        )
        planned = decision.planned or MovePart("")
        done = planned if result.ok else MovePart(f"remote prefill failed ({result.error}): prefilled here")
        return replace(route, decision=decision.carried(done), remote_prefill=result)


def plan_save(route: Route, end: TurnEnd) -> AfterTurn | None:
    """What a request served in full (status 200, timings, a session and pieces, its heads policy on) asks of the head
    store: its restore judged, its session's older state given up, and a save of its slot when its prompt has the
    policy's `min_tokens` or more (not on a router-mode preset): a session's first request the store saw there with no
    reply in its prompt is saved as an agent's head at once; any other turn of the session's main line as its
    session's state once it has been idle `session_idle_s` (0: never); a side request is not saved. None: nothing."""
    timings, policy, shown = end.timings, end.policy, end.shown
    if timings is None or end.status != 200 or route.session_id is None or not route.pieces or not policy.enabled:
        return None
    scope = end.owner[2]
    cache_n = None if timings.from_usage else timings.cache_n  # usage may leave cached tokens out: no judging on it
    judged = shown.restored if cache_n is not None else None
    after = AfterTurn(
        scope,
        int(policy.share_gb * 1024**3),
        judged,
        cache_n or 0,
        judged is not None and cache_n is not None and inert(judged.tokens, cache_n),
        session=None if route.decision.side else route.session_id,
        mark=shown.mark,
    )
    tokens = timings.prompt_n + timings.cache_n
    if tokens < policy.min_tokens or end.preset:
        return after
    history = any(p.assistant for p in route.pieces)  # a reply in the prompt: a session's state, not a head
    first = shown.first and not history
    agent, project, _ = end.owner
    turn = SavedTurn(
        tuple(p.digest for p in route.pieces),
        tuple(p.chars for p in route.pieces),
        tokens,
        timings.predicted_n,
        agent,
        project,
        scope,
        blocks=end.blocks() if first else (),
    )
    at = SlotAt(route.profile, route.replica, route.slot)
    if first:
        return replace(after, save=HeadSave(at, end.server, turn, shown.mark))
    if after.session and policy.session_idle_s > 0:
        state = replace(turn, session=after.session)
        return replace(after, save=HeadSave(at, end.server, state, shown.mark, policy.session_idle_s))
    return after
