"""A routing decision as the values of its stages, composed once: the profile, the prompt, the draft cap, the replica.

Each stage is decided apart and says only what it decides: `decide()` the profile (`Choice`), the prompt's estimate
what the chosen server must prefill (`PromptPart`), the draft-length rule the cap (`DraftCap`), `choose_replica()`
and the KV's reach the replica (`ReplicaPart`); what the KV moves did before forwarding (a warm start, a remote
prefill) comes after as `Moved` notes. `Decision` holds them and reads them out: a later stage's figure stands over
an earlier one's (a replica whose KV is out of reach prefills the whole prompt), and the reason is the stages' parts,
joined only where it is shown (`reason`), so no code reads a decision's text to learn what was decided.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from adaptive_spec.routing.estimate import Estimate
from adaptive_spec.routing.replicas import ReplicaKind

# How the profile was decided: a pin, the policy (forced, the only one allowed), the estimates (estimate, explore,
# stay where the KV lives, held back by the load rule), or a fallback when the rules' choice cannot serve.
DecisionKind = Literal["pinned", "forced", "only", "estimate", "explore", "stay", "load", "fallback"]


@dataclass(frozen=True, slots=True)
class Choice:
    """The profile stage (`decide()`): which profile, how it was decided and why, and what its estimate took."""

    profile: str
    kind: DecisionKind
    reason: str
    copy_share: float  # the copyability the estimate used
    context_tokens: int  # prompt tokens, estimated from the body
    acceptance: float = 0.0  # the drafter acceptance the estimate used (model-drafter profiles)
    moved_from: str | None = None  # the session's KV lived on this other profile
    handoff: bool = False  # save the slot on moved_from and restore it on `profile` before forwarding
    handoff_tokens: int = 0
    estimates: tuple[Estimate, ...] = ()


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
class Moved:
    """What a KV move before forwarding did (a warm start's restored head, a remote prefill): its part of the reason,
    and the tokens left to prefill when it changed them (None: as estimated)."""

    note: str
    new_tokens: int | None = None


_ONE_REPLICA = ReplicaPart()


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes and why: its stages, composed. Read it through the properties below."""

    choice: Choice
    prompt: PromptPart = PromptPart()
    draft: DraftCap | None = None
    placed: ReplicaPart = _ONE_REPLICA
    moves: tuple[Moved, ...] = ()

    def after(self, moved: Moved) -> Decision:
        """This decision with what a KV move did added as its last stage."""
        return replace(self, moves=(*self.moves, moved))

    @property
    def profile(self) -> str:
        return self.choice.profile

    @property
    def kind(self) -> DecisionKind:
        return self.choice.kind

    @property
    def reasons(self) -> tuple[str, ...]:
        """The reason's parts, stage by stage: the profile's, then each later stage that had something to say."""
        later = (
            self.draft.reason if self.draft is not None else "",
            self.placed.reason,
            *(m.note for m in self.moves),
        )
        return (self.choice.reason, *(part for part in later if part))

    @property
    def reason(self) -> str:
        """The reason as people read it: its parts joined."""
        return "; ".join(self.reasons)

    @property
    def copy_share(self) -> float:
        return self.choice.copy_share

    @property
    def context_tokens(self) -> int:
        return self.choice.context_tokens

    @property
    def acceptance(self) -> float:
        return self.choice.acceptance

    @property
    def moved_from(self) -> str | None:
        return self.choice.moved_from

    @property
    def estimates(self) -> tuple[Estimate, ...]:
        return self.choice.estimates

    @property
    def handoff(self) -> bool:
        return self.choice.handoff if self.placed.handoff is None else self.placed.handoff

    @property
    def handoff_tokens(self) -> int:
        placed = self.placed.handoff_tokens
        return self.choice.handoff_tokens if placed is None else placed

    @property
    def new_tokens(self) -> int | None:
        """The tokens to prefill: the latest stage's figure (a move's, the replica's, else the prompt's estimate)."""
        for moved in reversed(self.moves):
            if moved.new_tokens is not None:
                return moved.new_tokens
        return self.prompt.new_tokens if self.placed.new_tokens is None else self.placed.new_tokens

    @property
    def side(self) -> bool:
        return self.prompt.side

    @property
    def line_moved(self) -> bool:
        return self.prompt.line_moved

    @property
    def replica(self) -> int:
        return self.placed.replica

    @property
    def replica_kind(self) -> ReplicaKind:
        return self.placed.kind

    @property
    def replica_moved_from(self) -> int | None:
        return self.placed.moved_from

    @property
    def n_max(self) -> int | None:
        return self.draft.n_max if self.draft is not None else None
