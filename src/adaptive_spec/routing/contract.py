"""The router's API as the shell sees it: what a request asks (`RouteRequest`), what the router answers (`Route`, or a
`Refusal`), what the shell reports at the end (`Completion`, and `TurnEnd` for the head save), and what the router
needs from outside, injected as protocols: the profiles' health, the policy files, and its `Effects` — what it asks
of the KV layer while it plans, and where its events go (llama-swap's scheduler "calls back through Effects", its
syscall table).

None of it waits: the KV moves a route asks for are carried out by the request path (`requests/carry_out.py`), which
reports them back with `Router.moved`.

Values and protocols only."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from adaptive_spec.kv.heads.values import HeadsView, Restored, TurnShown
from adaptive_spec.kv.moves import HandoffResult, HeadRestore, PrefillAsk, RemotePrefillResult, SlotAt, SlotMove
from adaptive_spec.kv.remote_prefill.pricing import RemoteCosts
from adaptive_spec.policy.model import HeadsPolicy, Policy
from adaptive_spec.routing.decision import Decision
from adaptive_spec.routing.prompt.pieces import Piece
from adaptive_spec.routing.prompt.prefix import DEFAULT_CHARS_PER_TOKEN
from adaptive_spec.telemetry.events import Event
from adaptive_spec.telemetry.records import Timings


class ProfileHealth(Protocol):
    """The profiles by name and whether each is down (the proxy's upstream table): a profile is down when all its
    replicas are."""

    def names(self) -> list[str]: ...

    def down_reason(self, name: str) -> str | None: ...

    def replica_health(self, name: str) -> list[tuple[str, str | None]]:
        """Each replica's base URL and down reason (None: up), in replica order."""
        ...


class PolicySource(Protocol):
    """The routing policies by (project, workspace). `policy_for` reads no file: a pair not `known` gets the base
    policy until it is loaded; `load` and `refresh` read files, and the proxy calls them off its loop."""

    def known(self, project: str, workspace: str | None) -> bool: ...

    def policy_for(self, project: str, workspace: str | None) -> Policy: ...

    def load(self, project: str, workspace: str | None) -> Policy: ...

    def refresh(self) -> list[str]: ...

    def describe(self, project: str, workspace: str | None) -> dict[str, Any]: ...

    def problems(self) -> list[Any]: ...


class FixedPolicy:
    """One policy for every project (tests, and a proxy started without policy files)."""

    def __init__(self, policy: Policy | None = None) -> None:
        self.policy = policy or Policy()

    def known(self, project: str, workspace: str | None) -> bool:
        return True

    def policy_for(self, project: str, workspace: str | None) -> Policy:
        return self.policy

    def load(self, project: str, workspace: str | None) -> Policy:
        return self.policy

    def refresh(self) -> list[str]:
        return []

    def describe(self, project: str, workspace: str | None) -> dict[str, Any]:
        return {"sources": list(self.policy.sources), "problems": [], "policy": asdict(self.policy)}

    def problems(self) -> list[Any]:
        return []


class Effects(Protocol):
    """What the router asks of the world while it plans (implemented by `kv/effects.py`): synchronous, and none of it
    raises into a request."""

    def can_move(self, source: SlotAt, target: SlotAt) -> bool:
        """Whether a slot file saved by one server can be restored by the other."""
        ...

    def transfers(self, source: SlotAt, target: SlotAt) -> bool:
        """Whether that file crosses hosts (priced with its transfer time)."""
        ...

    @property
    def prefills_elsewhere(self) -> RemoteCosts | None:
        """The learned prices of the remote prefill there is to ask (`serve --pp-server`); None: none at all."""
        ...

    def publish(self, event: Event) -> None: ...


class NoEffects:
    """A router that asks for no move (the simulator's, tests', a proxy without a slot directory)."""

    def can_move(self, source: SlotAt, target: SlotAt) -> bool:
        return False

    def transfers(self, source: SlotAt, target: SlotAt) -> bool:
        return False

    @property
    def prefills_elsewhere(self) -> RemoteCosts | None:
        return None

    def publish(self, event: Event) -> None:
        return None


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the router needs of a generating request."""

    body: Mapping[str, Any]
    body_bytes: int
    session_id: str | None
    session_turns: int
    copy_share: float | None
    project: str
    workspace: str | None
    pinned: str | None  # the request header's profile; without one, the session's pin (if any) applies
    takes_slot: bool = False  # the request passes `id_slot` on (chat, completions; messages where 0006 is): a slot
    client_slot: int | None = None  # the client named one itself: the router follows it
    prefill_path: str | None = None  # the upstream path, when the request may be prefilled remotely
    # This prompt's characters per token, counted with the model's tokenizer by the shell (a long first turn: no
    # session state yet to take a rate from); None: the proxy's latest rate.
    chars_per_token: float | None = None
    # The request's policy, resolved by the shell before routing (a new pair's files read in a thread); None: the
    # router reads it from its policies' snapshot.
    policy: Policy | None = None
    # What the head store shows of each (profile, replica)'s server where this request may get a stored head restored
    # (a session's first request there: `HeadStore.view`), and each piece's `text_blocks`; none: no restore.
    heads: Mapping[tuple[str, int], HeadsView] = field(default_factory=dict)
    head_blocks: tuple[tuple[bytes, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class Route:
    """What to do with the request: where (profile, replica, slot), what was moved for it, and why (the decision's
    reason). The shell hands it back with the `Completion`."""

    decision: Decision
    slot: int | None
    session_id: str | None
    body_bytes: int
    # The KV move the route asks the request path to carry out before forwarding (`requests/carry_out.py`), and its
    # results.
    move: SlotMove | HeadRestore | PrefillAsk | None = None
    handoff: HandoffResult | None = None
    remote_prefill: RemotePrefillResult | None = None
    restored: Restored | None = None
    # The prompt as the session's prefix state saw it, for the completion to update it, and the characters per token
    # its estimate took.
    pieces: tuple[Piece, ...] = ()
    chars_per_token: float = DEFAULT_CHARS_PER_TOKEN
    has_tools: bool = False
    opening: float = 0.0  # the template's tokens ahead of the pieces its estimate counted (`prefix.total_tokens`)

    @property
    def profile(self) -> str:
        return self.decision.profile

    @property
    def replica(self) -> int:
        return self.decision.replica


@dataclass(frozen=True, slots=True)
class Refusal:
    """The request cannot be routed: the answer's status, message and error code."""

    status: int
    message: str
    code: str
    decision: Decision | None = None  # what was decided before the refusal (for the record)


@dataclass(frozen=True, slots=True)
class Completion:
    """How the routed request ended: served in full (`ok`) with llama-server's timings and the reply's text, or not
    (nothing is learned; the load comes down all the same)."""

    ok: bool
    timings: Timings | None = None
    reply: str = ""
    # The share of the reply its slot keeps reusable when it is sent back (`OutputCollector.kept_share`): a call
    # whose arguments the model spaced otherwise than the template does is prefilled again from there.
    reply_kept: float = 1.0


@dataclass(frozen=True, slots=True)
class TurnEnd:
    """A routed request as it ended, for the head save the router decides then (`move_planner.plan_save`): its status
    and llama-server's timings, its project's heads policy as resolved before routing, what the head store's tables
    show of it (`TurnShown`), the server that served it (`preset`: a router-mode preset, whose slots are not saved),
    whose it is (agent, project, tenant scope), and its pieces' `text_blocks`, read only for a first turn's save."""

    status: int
    timings: Timings | None
    policy: HeadsPolicy
    shown: TurnShown
    server: str
    preset: bool = False
    owner: tuple[str | None, str | None, str] = (None, None, "")
    blocks: Callable[[], tuple[tuple[bytes, ...], ...]] = tuple
