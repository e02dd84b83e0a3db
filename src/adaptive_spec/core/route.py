"""The routing decision: which profile will finish this request soonest, counting the cost of moving a session.

`decide` is pure: it sees the request, the session (its copyability and where its KV cache lives), the profiles'
health and load, the learned speeds and the policy in force, and returns a Decision with one human line of reason.

Cost of serving the request on profile p:

    prompt tokens p must process / prefill speed of p   (all of them when the session's KV lives elsewhere,
                                                         only the new ones when it lives on p)
  + slot save + restore                                  (when the KV is handed over instead of re-prefilled)
  + expected output tokens × seconds/token of p given the session's copyability and context

A session stays where its KV lives unless another profile is estimated faster by more than the hysteresis, and not
before it has dwelt `min_dwell_turns` there. A pin or a forced profile overrides the estimate; a profile that is
down or overloaded is passed over and the decision says why.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from adaptive_spec.core.policy import FirstTurnPolicy, Policy
from adaptive_spec.core.speeds import SpeedModel


@dataclass(frozen=True, slots=True)
class ProfileState:
    name: str
    down_reason: str | None = None
    in_flight: int = 0
    slots: int = 1
    handoff: bool = False  # shares a slot directory with the other profiles: its KV can be saved and restored
    draft_model: bool = False  # drafts with a separate draft model, whose own cache a slot file does not hold


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a session's KV cache lives: the profile (and slot) that served its last turn."""

    profile: str
    slot: int | None
    cached_tokens: int  # prompt + output of the last turn, cached in that slot
    turns_here: int  # consecutive turns served on this profile
    output_tokens: float  # average output tokens per turn (EWMA)
    # Whether the slot still holds this session. Another session served there since displaced it: the profile may
    # still have the prompt in its RAM cache, but a slot save would capture the other session's KV.
    in_slot: bool = True


@dataclass(frozen=True, slots=True)
class SessionState:
    session_id: str | None
    turns: int  # turns whose statistics are known
    copy_share: float | None  # estimated accepted share of n-gram drafts (EWMA over recent turns); None = no history
    placement: Placement | None


@dataclass(frozen=True, slots=True)
class RequestState:
    body_bytes: int
    max_tokens: int | None = None
    copy_hint: bool = False  # the prompt itself asks to reproduce a pasted file
    hint_output_tokens: int = 0  # ... and the answer will be about this long (the pasted file's size)
    pinned: str | None = None  # the x-adaptive-spec-profile header
    explore_draw: float = 1.0  # uniform in [0, 1): below policy.route.explore, try another profile


@dataclass(frozen=True, slots=True)
class Estimate:
    profile: str
    prefill_tokens: int
    prefill_s: float
    handoff_s: float  # slot save + restore, when the KV is handed over
    output_tokens: int
    decode_tps: float
    speedup: float  # decode speed over decoding without speculation, at this context
    total_s: float


@dataclass(frozen=True, slots=True)
class Decision:
    profile: str
    kind: str  # pinned | forced | estimate | stay | explore | fallback | only
    reason: str
    copy_share: float  # the copyability the estimate used
    context_tokens: int  # prompt tokens, estimated from the body
    moved_from: str | None = None  # the session's KV lived on this other profile
    handoff: bool = False  # save the slot on moved_from and restore it on `profile` before forwarding
    handoff_tokens: int = 0
    estimates: tuple[Estimate, ...] = ()


_FENCE = re.compile(r"```[^\n]*\n(.*?)(?:```|\Z)", re.S)


def looks_copy_heavy(instruction: str, policy: FirstTurnPolicy, earlier: Sequence[str] = ()) -> bool:
    """A request that asks for a file back whole ('return the complete updated file') with a block of at least
    `min_lines` lines pasted in this message or an earlier one: its answer copies the prompt, so n-gram drafting
    pays from the first token."""
    return pasted_chars(instruction, policy, earlier) > 0


def pasted_chars(instruction: str, policy: FirstTurnPolicy, earlier: Sequence[str] = ()) -> int:
    """The size of the file a copy-heavy request asks for back (the longest qualifying block), 0 when it is not
    one: the answer will be about that long."""
    lowered = instruction.lower()
    if not any(phrase.lower() in lowered for phrase in policy.phrases):
        return 0
    sizes = [
        size for text in (instruction, *earlier) for lines, size in [_longest_block(text)] if lines >= policy.min_lines
    ]
    return max(sizes, default=0)


def _longest_block(text: str) -> tuple[int, int]:
    """(lines, chars) of the longest fenced block, or of the whole text when it has no fences (a pasted file)."""
    blocks = _FENCE.findall(text)
    if blocks:
        longest = max(blocks, key=len)
        return longest.count("\n") + 1, len(longest)
    return text.count("\n") + 1, len(text)


def _fmt_tokens(n: int) -> str:
    return f"{n:,}"


def _estimate(
    p: ProfileState,
    request: RequestState,
    session: SessionState,
    copy: float,
    prompt_tokens: int,
    speeds: SpeedModel,
    policy: Policy,
    profiles: Mapping[str, ProfileState],
) -> Estimate:
    placement = session.placement
    handoff_s = 0.0
    prefill_tokens = prompt_tokens
    if placement is not None and placement.cached_tokens > 0:
        reuse = min(placement.cached_tokens, prompt_tokens)
        if placement.profile == p.name:
            prefill_tokens = prompt_tokens - reuse
        elif _can_hand_off(placement, p, policy, profiles):
            prefill_tokens = prompt_tokens - reuse
            handoff_s = speeds.handoff_s(placement.cached_tokens)
    out = placement.output_tokens if placement is not None else float(policy.estimator.output_tokens)
    if request.copy_hint and request.hint_output_tokens:
        out = max(out, float(request.hint_output_tokens))
    out_tokens = max(1, int(min(out, request.max_tokens) if request.max_tokens else out))
    context = prompt_tokens + out_tokens / 2
    s_per_token = speeds.decode_s_per_token(p.name, copy, context)
    prefill_s = speeds.prefill_s(p.name, prefill_tokens)
    return Estimate(
        profile=p.name, prefill_tokens=prefill_tokens, prefill_s=prefill_s, handoff_s=handoff_s,
        output_tokens=out_tokens, decode_tps=1.0 / s_per_token,
        speedup=speeds.plain_s_per_token(context) / s_per_token,
        total_s=prefill_s + handoff_s + out_tokens * s_per_token,
    )  # fmt: skip


def _can_hand_off(placement: Placement, to: ProfileState, policy: Policy, profiles: Mapping[str, ProfileState]) -> bool:
    source = profiles.get(placement.profile)
    return (
        policy.handoff.enabled
        and source is not None
        and source.down_reason is None
        and source.handoff
        and to.handoff
        and placement.in_slot
        and (policy.handoff.with_draft_models or not (source.draft_model or to.draft_model))
        and placement.cached_tokens > 0
        and placement.cached_tokens >= policy.handoff.min_tokens
    )


def _overloaded(p: ProfileState, policy: Policy) -> bool:
    return p.in_flight >= p.slots + policy.route.max_queue


def copyability(session: SessionState, request: RequestState, policy: Policy) -> tuple[float, str]:
    """The share of this turn's output an n-gram drafter is expected to produce, and where the figure comes from."""
    hint = policy.first_turn.copy_share if request.copy_hint else 0.0
    if session.copy_share is None:
        return hint, ("prompt asks for a pasted file back" if request.copy_hint else "no history")
    src = f"{session.turns}-turn avg" if session.turns > 1 else "last turn"
    if hint > session.copy_share:
        return hint, "prompt asks for a pasted file back"
    return session.copy_share, src


def decide(
    request: RequestState,
    session: SessionState,
    profiles: Sequence[ProfileState],
    speeds: SpeedModel,
    policy: Policy,
) -> Decision:
    by_name = {p.name: p for p in profiles}
    copy, copy_src = copyability(session, request, policy)
    prompt_tokens = speeds.prompt_tokens(request.body_bytes)
    placement = session.placement

    def decision(name: str, kind: str, reason: str, estimates: tuple[Estimate, ...] = ()) -> Decision:
        moved = placement.profile if placement is not None and placement.profile != name else None
        handoff = moved is not None and _can_hand_off(placement, by_name[name], policy, by_name)  # type: ignore[arg-type]
        return Decision(
            profile=name, kind=kind, reason=reason, copy_share=copy, context_tokens=prompt_tokens, moved_from=moved,
            handoff=handoff, handoff_tokens=placement.cached_tokens if handoff and placement else 0,
            estimates=estimates,
        )  # fmt: skip

    if request.pinned is not None and request.pinned in by_name:
        return decision(request.pinned, "pinned", f"{request.pinned}: pinned by the request header")

    allowed = [by_name[n] for n in policy.route.profiles if n in by_name] or list(profiles)
    healthy = [p for p in allowed if p.down_reason is None]
    usable = [p for p in healthy if not _overloaded(p, policy)]
    if not usable:
        usable = sorted(healthy, key=lambda p: p.in_flight - p.slots)[:1]
    if not usable:  # nothing healthy among the allowed profiles: try any healthy one
        usable = [p for p in profiles if p.down_reason is None][:1]
    if not usable:
        first = allowed[0] if allowed else profiles[0]
        return decision(first.name, "fallback", f"{first.name}: every profile is down")

    def passed_over(name: str) -> str | None:
        p = by_name.get(name)
        if p is None:
            return None
        if p.down_reason is not None:
            return f"{name} is down ({p.down_reason})"
        if _overloaded(p, policy):
            return f"{name} is overloaded ({p.in_flight} in flight for {p.slots} slot(s))"
        return None

    force = policy.route.force
    if force is not None and force in by_name:
        why = passed_over(force)
        if why is None:
            return decision(force, "forced", f"{force}: forced by the policy")
        alt = min(
            (_estimate(p, request, session, copy, prompt_tokens, speeds, policy, by_name) for p in usable),
            key=lambda e: e.total_s,
        ).profile
        return decision(alt, "fallback", f"{alt}: the policy forces {force}, but {why}")

    if len(allowed) == 1 and usable[0].name == allowed[0].name:
        return decision(usable[0].name, "only", f"{usable[0].name}: the only profile the policy allows")

    if placement is None and copy <= 0.0:
        # A first turn with nothing to copy goes to a profile without n-gram drafting (its pool starts empty and
        # the estimate could only tell noise apart), when the policy allows one.
        plain = [p for p in allowed if not speeds.is_ngram(p.name)]
        if plain:
            allowed = plain
            usable = [p for p in usable if not speeds.is_ngram(p.name)] or usable
    everywhere = {p.name: _estimate(p, request, session, copy, prompt_tokens, speeds, policy, by_name) for p in allowed}
    estimates = tuple(everywhere[p.name] for p in usable if p.name in everywhere) or tuple(
        _estimate(p, request, session, copy, prompt_tokens, speeds, policy, by_name) for p in usable
    )  # order = the policy's order: ties go to the first
    best = min(estimates, key=lambda e: e.total_s)
    by_est = {e.profile: e for e in estimates}
    here = by_est.get(placement.profile) if placement is not None else None

    if placement is not None and here is None:  # its KV lives on a profile that is down or overloaded
        why = passed_over(placement.profile) or f"{placement.profile} is not allowed by the policy"
        return decision(best.profile, "fallback", f"{best.profile}: {why}; {_move_text(best, placement)}", estimates)
    ideal = min(everywhere.values(), key=lambda e: e.total_s) if everywhere else best
    if placement is None and ideal.profile != best.profile:  # the estimated best is down or overloaded
        why = passed_over(ideal.profile)
        reason = f"{best.profile}: {why}, the estimate's choice; copyable {copy:.0%} ({copy_src})"
        return decision(best.profile, "fallback", reason, estimates)

    if here is not None and best.profile != here.profile:
        assert placement is not None
        gain = 1.0 - best.total_s / here.total_s if here.total_s > 0 else 0.0
        if placement.turns_here < policy.route.min_dwell_turns and placement.cached_tokens > 0:
            reason = (
                f"{here.profile}: stays (turn {placement.turns_here} of a {policy.route.min_dwell_turns}-turn dwell); "
                f"{best.profile} est {gain:.0%} faster; copyable {copy:.0%} ({copy_src})"
            )
            return decision(here.profile, "stay", reason, estimates)
        if gain < policy.route.hysteresis:
            reason = (
                f"{here.profile}: stays; {best.profile} est only {gain:.0%} faster (hysteresis "
                f"{policy.route.hysteresis:.0%}); copyable {copy:.0%} ({copy_src})"
            )
            return decision(here.profile, "stay", reason, estimates)

    chosen = best
    kind = "estimate"
    if placement is None and request.explore_draw < policy.route.explore and len(estimates) > 1:
        chosen = sorted(estimates, key=lambda e: e.total_s)[1]
        kind = "explore"
    return decision(chosen.profile, kind, _reason(chosen, estimates, copy, copy_src, placement, kind), estimates)


def _move_text(chosen: Estimate, placement: Placement | None) -> str:
    if placement is None:
        return f"new session, prefills {_fmt_tokens(chosen.prefill_tokens)} tok ≈ {chosen.prefill_s:.2f} s"
    if placement.profile == chosen.profile:
        return f"stays on its KV cache ({_fmt_tokens(chosen.prefill_tokens)} new tok ≈ {chosen.prefill_s:.2f} s)"
    if chosen.handoff_s > 0:
        return (
            f"hands its KV over from {placement.profile} ({_fmt_tokens(placement.cached_tokens)} tok ≈ "
            f"{chosen.handoff_s:.2f} s)"
        )
    return f"switch re-prefills {_fmt_tokens(chosen.prefill_tokens)} tok ≈ {chosen.prefill_s:.2f} s"


def _reason(
    chosen: Estimate,
    estimates: tuple[Estimate, ...],
    copy: float,
    copy_src: str,
    placement: Placement | None,
    kind: str,
) -> str:
    others = [e for e in estimates if e.profile != chosen.profile]
    vs = ", ".join(f"{e.profile} {e.speedup:.1f}× ({e.total_s:.1f} s)" for e in others)
    head = f"{chosen.profile}: copyable {copy:.0%} ({copy_src}) → est {chosen.speedup:.1f}× ({chosen.total_s:.1f} s)"
    if vs:
        head += f" vs {vs}"
    tail = _move_text(chosen, placement)
    if placement is not None and placement.profile != chosen.profile and others:
        stay = next((e for e in others if e.profile == placement.profile), None)
        if stay is not None:
            tail += f", pays back this turn (saves {stay.total_s - chosen.total_s:.1f} s)"
    if kind == "explore":
        tail += "; exploring: not the estimated best, to measure it"
    return f"{head}; {tail}"


class Placements:
    """Where each session's KV cache lives (bounded: least recently used sessions are forgotten)."""

    def __init__(self, max_sessions: int = 4096, alpha: float = 0.5) -> None:
        self._by_session: OrderedDict[str, Placement] = OrderedDict()
        self.max_sessions, self.alpha = max_sessions, alpha

    def get(self, session_id: str | None) -> Placement | None:
        return self._by_session.get(session_id) if session_id is not None else None

    def served(self, session_id: str, profile: str, slot: int | None, cached_tokens: int, output_tokens: int) -> None:
        old = self._by_session.pop(session_id, None)
        turns = old.turns_here + 1 if old is not None and old.profile == profile else 1
        out = float(output_tokens) if old is None else self.alpha * output_tokens + (1 - self.alpha) * old.output_tokens
        self._by_session[session_id] = Placement(profile, slot, cached_tokens, turns, out)
        while len(self._by_session) > self.max_sessions:
            self._by_session.popitem(last=False)

    def displace(self, profile: str, slot: int | None, keep: str | None) -> None:
        """`keep` now occupies this slot (served there, or restored into it; None: nobody, it was erased): the other
        sessions it held are out of the slot (their prompts may live on in the profile's RAM cache, so their cached
        figures stay)."""
        for sid, p in list(self._by_session.items()):
            if sid != keep and p.in_slot and p.profile == profile and p.slot == slot:
                self._by_session[sid] = replace(p, in_slot=False)

    def __len__(self) -> int:
        return len(self._by_session)

    def items(self) -> list[tuple[str, Placement]]:
        return list(self._by_session.items())
