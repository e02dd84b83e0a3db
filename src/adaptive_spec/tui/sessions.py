"""A session as the TUI shows it: its turns read from the request records (llama-server's own timings) beside the
router's estimate, the live text of its answer, and which sessions the table lists in what order (no Textual)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from adaptive_spec.telemetry.records import RequestRecord

TEXT_CHARS = 4000  # the live text of an in-flight request keeps its last characters
SORTS = ("last active", "turns", "accepted", "tok/s", "profile")


@dataclass(slots=True)
class TurnRow:
    """One request of a session, from its record (llama-server's figures) and the session's estimate."""

    request_id: str
    started_at_unix: float
    profile: str
    api: str
    outcome: str
    status: int
    error: str | None
    prompt_n: int
    cache_n: int
    predicted_n: int
    draft_n: int
    draft_n_accepted: int
    tokens_per_s: float | None
    ttft_ms: float | None
    ttst_ms: float | None
    route: str | None
    reason: str | None
    moved_from: str | None
    handoff_tokens: int | None
    handoff_ms: float | None
    handoff_ok: bool = False
    est_accepted_share: float | None = None
    predicted_ms: float = 0.0  # llama-server's decode time (the profile's since-start speed sums it)
    handoff_reused: int | None = None  # of the restored tokens, what its prompt reused (llama-server's cache_n)
    setting: str | None = None  # the speculation it ran with ("none", "draft-simple n_max=4", ...); None: the server's
    repeat_guard: str | None = None  # what the proxy did to break a loop of one tool call, if anything
    repaired: str | None = None  # what it rewrote of a shape llama-server refuses, if anything
    # The route's prefill estimate against llama-server's prompt_ms (estimated / measured − 1), and whether the speeds
    # it took were the priors or measured; None: no estimate to judge (record `time_estimate`).
    prefill_error: float | None = None
    estimate_basis: str | None = None

    @property
    def accepted_share(self) -> float | None:
        """The share of its output that came from drafts; None when nothing was drafted (shown as "—", as the
        profiles panel shows a profile that drafts nothing)."""
        return self.draft_n_accepted / self.predicted_n if self.predicted_n and self.draft_n else None


@dataclass(slots=True)
class LiveRequest:
    request_id: str
    session_id: str | None
    profile: str
    started_at_unix: float
    predicted_n: int = 0
    draft_n: int = 0
    draft_n_accepted: int = 0
    tokens_per_s: float = 0.0
    text: deque[tuple[str, bool]] = field(default_factory=deque)  # (text, came from accepted drafts)
    text_chars: int = 0

    def add_text(self, segments: Iterable[tuple[str, bool]]) -> None:
        for text, drafted in segments:
            self.text.append((text, drafted))
            self.text_chars += len(text)
        while self.text_chars > TEXT_CHARS and len(self.text) > 1:
            self.text_chars -= len(self.text.popleft()[0])


@dataclass(slots=True)
class SessionView:
    session_id: str
    project: str = "default"
    client: str = "?"
    turns: list[TurnRow] = field(default_factory=list)
    stats_turns: int = 0  # turns folded into the session's statistics by the proxy
    est_copyability: float | None = None
    profile: str | None = None
    in_flight: str | None = None
    pinned: str | None = None  # pinned to this profile (POST /adaptive/sessions/{id}/pin)
    last_text: LiveRequest | None = None  # the last answer's live text, once it finished
    last_reason: str | None = None
    last_active: float = 0.0

    @property
    def moves(self) -> int:
        return sum(1 for t in self.turns if t.moved_from)

    @property
    def predicted_n(self) -> int:
        return sum(t.predicted_n for t in self.turns)

    @property
    def draft_n(self) -> int:
        return sum(t.draft_n for t in self.turns)

    @property
    def draft_n_accepted(self) -> int:
        return sum(t.draft_n_accepted for t in self.turns)

    @property
    def accepted_share(self) -> float | None:
        """The share of the session's output that came from drafts; None when none of its turns drafted."""
        out = self.predicted_n
        return self.draft_n_accepted / out if out and self.draft_n else None

    @property
    def last_turn(self) -> TurnRow | None:
        return self.turns[-1] if self.turns else None


def client_of(source: str | None, client: str | None = None) -> str:
    """The agent behind a session: the record's own client name when it has one, else a guess from how the
    session was recognised (opencode sends x-session-id, Codex CLI session-id and prompt_cache_key)."""
    if client:
        return client
    source = source or ""
    if "x-session-id" in source or "x-session-affinity" in source:
        return "opencode"
    if "session-id" in source or "prompt_cache_key" in source:
        return "codex"
    if "claude" in source.lower():
        return "claude-code"
    return "?"


def number(value: Any) -> float | None:
    """A JSON number of a record or snapshot; None for anything else."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def whole(value: Any) -> int:
    """A JSON count of a record or snapshot; 0 for anything else."""
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def turn_row(record: RequestRecord) -> TurnRow:
    """A request record (as /adaptive/requests and the feed carry it, decoded) as a row of its session's turns."""
    timings, handoff = record.timings, record.handoff
    handoff_ms = None
    if handoff is not None:
        handoff_ms = ((number(handoff.get("save_s")) or 0.0) + (number(handoff.get("restore_s")) or 0.0)) * 1000
    return TurnRow(
        request_id=record.request_id,
        started_at_unix=record.started_at_unix,
        profile=record.profile,
        api=record.api,
        outcome=record.outcome or "finished",
        status=record.status,
        error=record.error,
        prompt_n=timings.prompt_n if timings else 0,
        cache_n=timings.cache_n if timings else 0,
        predicted_n=timings.predicted_n if timings else 0,
        draft_n=timings.draft_n if timings else 0,
        draft_n_accepted=timings.draft_n_accepted if timings else 0,
        tokens_per_s=timings.predicted_per_second if timings else None,
        ttft_ms=record.ttft_ms,
        ttst_ms=record.ttst_ms,
        route=record.route,
        reason=record.reason,
        moved_from=record.moved_from,
        handoff_tokens=whole(handoff.get("tokens")) if handoff else None,
        handoff_ms=handoff_ms,
        handoff_ok=bool(handoff.get("ok")) if handoff else False,
        predicted_ms=timings.predicted_ms if timings else 0.0,
        setting=setting_text(record.speculation),
        handoff_reused=whole(handoff.get("reused")) if handoff and "reused" in handoff else None,
        repeat_guard=record.repeat_guard,
        repaired=record.repaired,
        prefill_error=number((record.time_estimate or {}).get("prefill_error")),
        estimate_basis=str((record.time_estimate or {}).get("basis") or "") or None,
    )


def setting_text(speculation: Mapping[str, Any] | None) -> str | None:
    """The per-request speculation a record ran with, as the turn's detail shows it: its types ("none" for no
    speculation), its draft length, and who set it; None when it named nothing (the server's own setup)."""
    if not speculation:
        return None
    types = speculation.get("types")
    if isinstance(types, list):
        text = ",".join(str(t) for t in types) or "none"
    elif isinstance(types, str):
        text = types or "none"
    else:
        text = "the server's types"
    n_max = speculation.get("n_max")
    if isinstance(n_max, int) and not isinstance(n_max, bool):
        text += f" n_max={n_max}"
    by = speculation.get("set_by")
    return f"{text} (set by the {by})" if isinstance(by, str) and by else text


def shown(sessions: Iterable[SessionView], needle: str, sort: str) -> list[SessionView]:
    """The sessions the table lists: those whose id, client, project or profile holds `needle`, in `sort` order
    (one of SORTS)."""
    views = list(sessions)
    needle = needle.lower()
    if needle:
        views = [v for v in views if needle in f"{v.session_id} {v.client} {v.project} {v.profile or ''}".lower()]
    if sort == "turns":
        views.sort(key=lambda v: len(v.turns), reverse=True)
    elif sort == "accepted":
        views.sort(key=lambda v: v.accepted_share or -1.0, reverse=True)
    elif sort == "tok/s":
        views.sort(key=lambda v: (v.last_turn.tokens_per_s or 0.0) if v.last_turn else 0.0, reverse=True)
    elif sort == "profile":
        views.sort(key=lambda v: v.profile or "")
    else:
        views.sort(key=lambda v: v.last_active, reverse=True)
    return views
