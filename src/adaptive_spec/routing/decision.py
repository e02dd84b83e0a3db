"""A routing decision as the values of its stages, composed once: the profile, the prompt, the draft cap, the replica.

Each stage is decided apart and says only what it decides: `decide()` the profile (`Choice`), the prompt's estimate
what the chosen server must prefill (`PromptPart`), the draft-length rule the cap (`DraftCap`), `choose_replica()`
and the KV's reach the replica (`ReplicaPart`). `compose` builds the `Decision` from them in one step: a later
stage's figure stands over an earlier one's (a replica whose KV is out of reach prefills the whole prompt). The KV move
the route asks for before forwarding (a head restore) is its last stage, planned with the route (`Decision.planning`:
its estimate counts the move from the start), and what the move did replaces it once it is carried out
(`Decision.carried`); a move's note alone comes after as a `MovePart` stage (`Decision.after`).
A reason is the stages' parts (`reasons`), joined only where people read it (`reason`), so no code reads a
decision's text to learn what was decided.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from adaptive_spec.routing.estimate import Estimate
from adaptive_spec.routing.replicas import ReplicaKind
from adaptive_spec.telemetry.records import TimeEstimate, Timings

# How the profile was decided: a pin, the policy (forced, the only one allowed), the estimates (estimate, explore,
# stay where the KV lives, held back by the load rule), or a fallback when the rules' choice cannot serve.
DecisionKind = Literal["pinned", "forced", "only", "estimate", "explore", "stay", "load", "fallback"]


@dataclass(frozen=True, slots=True)
class Choice:
    """The profile stage (`decide()`): which profile, how it was decided and why, and what its estimate took."""

    profile: str
    kind: DecisionKind
    reasons: tuple[str, ...]  # the reason's parts, in the order they were found
    copy_share: float  # the copyability the estimate used
    context_tokens: int  # prompt tokens, estimated from the body
    acceptance: float = 0.0  # the drafter acceptance the estimate used (model-drafter profiles)
    moved_from: str | None = None  # the session's KV lived on this other profile
    handoff: bool = False  # save the slot on moved_from and restore it on `profile` before forwarding
    handoff_tokens: int = 0
    estimates: tuple[Estimate, ...] = ()

    @property
    def reason(self) -> str:
        """The reason as people read it: its parts joined."""
        return "; ".join(self.reasons)


@dataclass(frozen=True, slots=True)
class PromptPart:
    """The prompt stage: what the chosen server's KV does not hold, and which line of its session the request is."""

    new_tokens: int | None = None  # estimated tokens to prefill there (None: no estimate)
    side: bool = False  # a side request of its session (title, commit message): not a turn of its main line
    line_moved: bool = False  # this request starts the session's main line: the requests before it were side ones


@dataclass(frozen=True, slots=True)
class DraftCap:
    """The draft-length stage (`routing/draft_length.py`): the cap on a sequential drafter's draft, and why."""

    n_max: int
    reason: str


@dataclass(frozen=True, slots=True)
class ReplicaPart:
    """The replica stage (`choose_replica()`, and whether the session's KV can follow it there). A figure left None
    is the profile stage's."""

    replica: int = 0
    kind: ReplicaKind = "only"
    reason: str = ""  # empty for a profile with one replica
    moved_from: int | None = None  # the session's KV lived on this other replica of the same profile
    handoff: bool | None = None
    handoff_tokens: int | None = None
    new_tokens: int | None = None  # the whole prompt, where the KV is out of reach


@dataclass(frozen=True, slots=True)
class MovePart:
    """A KV move's stage (a head restore, a remote prefill), planned or done: its part of the reason, and the tokens
    left to prefill once it is made (None: as estimated)."""

    note: str
    new_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Decision(Choice):
    """Where a request goes and why: the profile stage's choice, with what the later stages decided (`compose`)."""

    new_tokens: int | None = None  # estimated tokens the profile's KV does not hold (None: no estimate)
    side: bool = False
    line_moved: bool = False
    # Which replica of the profile (routing/replicas.py chooses it after the profile is decided).
    replica: int = 0
    replica_kind: ReplicaKind = "only"
    replica_moved_from: int | None = None  # the session's KV lived on this other replica of the same profile
    # The draft length the router caps this request at (`speculative.n_max`; None: the profile's own setting).
    n_max: int | None = None
    # The move the route asks for, as planned (`planning`): its note is the last of `reasons`, its figure
    # `new_tokens`; `unmoved_tokens` is the estimate without it (the figure again should it not be made).
    planned: MovePart | None = None
    unmoved_tokens: int | None = None

    def time_estimate(self, timings: Timings | None) -> TimeEstimate | None:
        """The chosen profile's estimate against what llama-server measured: the prefill of the tokens this decision
        left to prefill (after a warm start's or a remote prefill's, fewer), the decode at the answer's true length.
        None without an estimate (pinned, forced, the only profile) or llama-server's timings."""
        chosen = next((e for e in self.estimates if e.profile == self.profile), None)
        if chosen is None or timings is None or timings.from_usage:
            return None
        new = chosen.prefill_tokens if self.new_tokens is None else self.new_tokens
        prefill_s = chosen.prefill_rate.seconds(new, max(0, self.context_tokens - new))
        return TimeEstimate(
            basis=chosen.basis,
            prefill_s_est=prefill_s,
            prefill_s=timings.prompt_ms / 1000.0,
            decode_s_est=timings.predicted_n / chosen.decode_tps,
            decode_s=timings.predicted_ms / 1000.0,
        )

    def after(self, moved: MovePart) -> Decision:
        """This decision with what a KV move did as its last stage."""
        tokens = self.new_tokens if moved.new_tokens is None else moved.new_tokens
        return replace(self, reasons=(*self.reasons, moved.note), new_tokens=tokens)

    def planning(self, move: MovePart) -> Decision:
        """This decision with the move its route asks for as its last stage: the estimate counts the move."""
        return replace(self.after(move), planned=move, unmoved_tokens=self.new_tokens)

    def carried(self, done: MovePart | None) -> Decision:
        """This decision with its planned move's stage replaced by what the move did (None: it was not made, and the
        estimate is the one without it)."""
        if self.planned is None:
            return self if done is None else self.after(done)
        unmoved = replace(
            self, reasons=self.reasons[:-1], new_tokens=self.unmoved_tokens, planned=None, unmoved_tokens=None
        )
        return unmoved if done is None else unmoved.after(done)


_ONE_REPLICA = ReplicaPart()


def compose(
    choice: Choice, prompt: PromptPart = PromptPart(), draft: DraftCap | None = None, placed: ReplicaPart = _ONE_REPLICA
) -> Decision:
    """The decision of these stages: each figure from the latest stage that has one, the reason's parts in order."""
    later = (draft.reason if draft is not None else "", placed.reason)
    return Decision(
        profile=choice.profile,
        kind=choice.kind,
        reasons=(*choice.reasons, *(part for part in later if part)),
        copy_share=choice.copy_share,
        context_tokens=choice.context_tokens,
        acceptance=choice.acceptance,
        moved_from=choice.moved_from,
        handoff=choice.handoff if placed.handoff is None else placed.handoff,
        handoff_tokens=choice.handoff_tokens if placed.handoff_tokens is None else placed.handoff_tokens,
        estimates=choice.estimates,
        new_tokens=prompt.new_tokens if placed.new_tokens is None else placed.new_tokens,
        side=prompt.side,
        line_moved=prompt.line_moved,
        replica=placed.replica,
        replica_kind=placed.kind,
        replica_moved_from=placed.moved_from,
        n_max=draft.n_max if draft is not None else None,
    )
