"""Values that describe one proxied request; a leaf module with no internal imports."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True, slots=True)
class Timings:
    """What llama-server reported for one response. `draft_n`/`draft_n_accepted` are 0 when absent (no drafts)."""

    prompt_n: int = 0
    cache_n: int = 0
    predicted_n: int = 0
    prompt_ms: float = 0.0
    predicted_ms: float = 0.0
    predicted_per_second: float = 0.0
    draft_n: int = 0
    draft_n_accepted: int = 0
    # The model drafter's part of those (DFlash, EAGLE3, MTP, a draft model), from the patched server's
    # `draft_by_type`; the rest is the n-gram drafters'. 0 where the server does not split its counts (stock).
    drafter_n: int = 0
    drafter_n_accepted: int = 0
    from_usage: bool = False  # True when only `usage` was reported: no speeds, no draft counts


@dataclass(frozen=True, slots=True)
class TimeEstimate:
    """A request's prefill and decode time as the router estimated them, against llama-server's own (`prompt_ms`,
    `predicted_ms`). The decode estimate is at the answer's true length (its seconds per token × `predicted_n`): the
    speed is the router's to know, not how long an answer will be. `basis`: the speeds the estimate took were the
    policy's priors, or measured (at start, kept from an earlier run, or learned from requests served)."""

    basis: str
    prefill_s_est: float
    prefill_s: float
    decode_s_est: float
    decode_s: float

    @staticmethod
    def error(estimated: float, measured: float) -> float | None:
        """Estimated over measured, less 1 (+0.5: estimated half as long again; −0.8: a fifth of the time)."""
        return round(estimated / measured - 1.0, 4) if measured > 0 else None

    def to_json(self) -> dict[str, Any]:
        return {
            "basis": self.basis,
            "prefill_s_est": round(self.prefill_s_est, 4),
            "prefill_s": round(self.prefill_s, 4),
            "prefill_error": self.error(self.prefill_s_est, self.prefill_s),
            "decode_s_est": round(self.decode_s_est, 4),
            "decode_s": round(self.decode_s, 4),
            "decode_error": self.error(self.decode_s_est, self.decode_s),
        }


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request as the proxy saw it, from arrival to the last byte sent to the client."""

    request_id: str
    started_at_unix: float
    method: str
    path: str
    api: str  # an `Api` (requests/apis.py): a plain string below `requests/` and as read back from a trace
    project: str
    session_id: str | None
    session_source: str | None  # how the session was recognised: header:…, body:…, echo:…, new
    subagent: bool  # a subagent's request, grouped under its parent session
    profile: str
    stream: bool
    status: int
    outcome: str  # "finished" or "failed"
    error: str | None
    timings: Timings | None
    ttft_ms: float | None
    ttst_ms: float | None
    total_ms: float
    route: str | None = None  # how the profile was chosen: pinned, forced, estimate, stay, explore, fallback, only
    reason: str | None = None  # the routing decision in one line
    moved_from: str | None = None  # the session's KV cache lived on this other profile before this request
    handoff: dict[str, Any] | None = None  # the KV slot save/restore before forwarding, when the session moved
    remote_prefill: dict[str, Any] | None = None  # the prompt prefilled on --pp-server and its slot restored here
    client: str | None = None  # the agent, from its User-Agent (opencode, codex, aider, …)
    new_tokens_est: int | None = None  # the router's estimate of the prompt tokens to prefill (truth: prompt_n)
    side: bool = False  # a side request of its session (a title, a commit message): not one of its turns
    replica: int = 0  # which server of the profile's pool served it (0 for a profile of one server)
    replica_moved_from: int | None = None  # the session's KV lived on this other server of the same pool
    # The per-request speculation it ran with: {"types", "n_max", "set_by": profile|client|profile+client}; None:
    # nothing named, the server's own (a stock server, or a profile that names nothing).
    speculation: dict[str, Any] | None = None
    # The body was changed to break an agent's loop on one tool call (requests/body/repeats.py): what, else None.
    repeat_guard: str | None = None
    # A shape llama-server refuses (an agent's), rewritten into one it takes (requests/body/compat.py): what, else None.
    repaired: str | None = None
    # The model the client asked for, as it named it (a Gemini request's from its path); None: it named none.
    model: str | None = None
    # A translated request's fields (Gemini's) taken but not honoured by a local model, comma-separated
    # ("generationConfig.thinkingConfig, safetySettings"); else None.
    not_honoured: str | None = None
    # The proxy's own request, not a client's: what it was for ("speed measurement": a launched server's speeds
    # measured at start, requests/measured_speeds.py); None for a client's.
    own: str | None = None
    # The route's prefill and decode time estimates against llama-server's timings (TimeEstimate.to_json, with
    # each one's error); None without an estimate (a pinned or forced route) or without timings.
    time_estimate: dict[str, Any] | None = None
    # An agent's wait that the keep-alives cannot reset, when this request came near it: how long it waited and what
    # to set (sessions/agents/client_limits.py); else None.
    client_limit: str | None = None

    def to_json(self) -> dict[str, Any]:
        """As `asdict` makes it, field by field (asdict's deep copy of every value cost a tenth of a request's own
        work); the dicts it holds (handoff, remote_prefill) are shared, as records never change."""
        out = {name: getattr(self, name) for name in _RECORD_FIELDS}
        if self.timings is not None:
            out["timings"] = {name: getattr(self.timings, name) for name in _TIMINGS_FIELDS}
        return out


_RECORD_FIELDS = tuple(f.name for f in fields(RequestRecord))
_TIMINGS_FIELDS = tuple(f.name for f in fields(Timings))


def own_record(
    request_id: str,
    *,
    own: str,
    path: str,
    api: str,
    profile: str,
    replica: int,
    timings: Timings | None,
    error: str | None,
    started_at_unix: float,
    total_ms: float,
) -> RequestRecord:
    """The record of a request the proxy sent of its own accord (`own` says what for): no client, no session."""
    finished = error is None and timings is not None
    return RequestRecord(
        request_id=request_id,
        started_at_unix=started_at_unix,
        method="POST",
        path=path,
        api=api,
        project="",
        session_id=None,
        session_source=None,
        subagent=False,
        profile=profile,
        stream=False,
        status=200 if finished else 502,
        outcome="finished" if finished else "failed",
        error=error if error is not None or finished else "no timings in the answer",
        timings=timings,
        ttft_ms=None,
        ttst_ms=None,
        total_ms=total_ms,
        client="adaptive-spec",
        replica=replica,
        own=own,
    )
