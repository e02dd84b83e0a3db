"""The TUI's picture of the proxy: a pure fold of feed events and HTTP snapshots into view state.

No Textual and no HTTP here, so the picture is tested on its own and is the same whether the events come from a live
proxy or a replayed trace. Every figure of drafted and accepted tokens is summed from the request records, which carry
llama-server's own `timings`; the live 1-second figures come from the draft progress events in between.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from adaptive_spec.tui import pools as replicas_view

WINDOW_S = 1.0  # the live decode rate and acceptance: a 1-second sliding window
CHART_SECONDS = 600  # the acceptance and speed chart keeps the last 10 minutes, one point a second
LOG_LINES = 500
TEXT_CHARS = 4000  # the live text of an in-flight request keeps its last characters
FINISHED_REQUESTS = 5000  # request ids remembered to drop duplicates between the history and the feed


@dataclass(slots=True)
class ChartPoint:
    at_unix: float
    tokens_per_s: float
    acceptance: float | None  # share of this second's output tokens that came from accepted drafts


@dataclass(slots=True)
class ProfileView:
    name: str
    base_url: str = ""
    up: bool = True
    reason: str | None = None
    model: str | None = None
    spec_types: tuple[str, ...] = ()
    n_ctx: int | None = None
    slots: int | None = None
    default: bool = False
    in_flight: set[str] = field(default_factory=set)
    window: deque[tuple[float, int, int]] = field(default_factory=deque)  # (at, output tokens, accepted) deltas
    requests: int = 0
    predicted_n: int = 0
    draft_n: int = 0
    draft_n_accepted: int = 0
    predicted_ms: float = 0.0
    chart: deque[ChartPoint] = field(default_factory=lambda: deque(maxlen=CHART_SECONDS))
    _bucket: list[int] = field(default_factory=lambda: [0, 0])  # this second's output and accepted tokens
    replicas: dict[int, replicas_view.ReplicaView] = field(default_factory=dict)  # a pool's servers (2 or more)

    @property
    def busy(self) -> int:
        return len(self.in_flight) if self.slots is None else min(len(self.in_flight), self.slots)

    @property
    def queued(self) -> int:
        return 0 if self.slots is None else max(0, len(self.in_flight) - self.slots)

    @property
    def drafts(self) -> bool:
        return any(t not in ("", "none") for t in self.spec_types)

    def live(self, now: float) -> tuple[float, float | None]:
        """(decode tok/s, acceptance) over the last WINDOW_S seconds."""
        while self.window and self.window[0][0] < now - WINDOW_S:
            self.window.popleft()
        out = sum(w[1] for w in self.window)
        acc = sum(w[2] for w in self.window)
        return out / WINDOW_S, (acc / out if out else None)

    @property
    def acceptance_total(self) -> float | None:
        """Share of output tokens that came from accepted drafts, since the view started."""
        return self.draft_n_accepted / self.predicted_n if self.predicted_n else None

    @property
    def tokens_per_s_total(self) -> float | None:
        return self.predicted_n / (self.predicted_ms / 1000) if self.predicted_ms > 0 else None

    def add_output(self, at: float, output: int, accepted: int) -> None:
        if output <= 0 and accepted <= 0:
            return
        self.window.append((at, output, accepted))
        self._bucket[0] += output
        self._bucket[1] += accepted

    def sample(self, at: float) -> None:
        out, acc = self._bucket
        self.chart.append(ChartPoint(at, float(out), acc / out if out else None))
        self._bucket = [0, 0]


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

    @property
    def accepted_share(self) -> float | None:
        return self.draft_n_accepted / self.predicted_n if self.predicted_n else None


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
        out = self.predicted_n
        return self.draft_n_accepted / out if out else None

    @property
    def last_turn(self) -> TurnRow | None:
        return self.turns[-1] if self.turns else None


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


@dataclass(frozen=True, slots=True)
class LogLine:
    at_unix: float
    kind: str  # start, finish, fail, handoff, policy, profile, note
    who: str
    text: str


def _short(session_id: str | None) -> str:
    if not session_id:
        return "-"
    return session_id if len(session_id) <= 12 else session_id[:11] + "…"


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


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


class Dashboard:
    """Everything the screens show. `apply` takes one feed event (its type and JSON payload); the caller passes
    the clock (`now`), so a replay runs on its own time."""

    def __init__(self) -> None:
        self.profiles: dict[str, ProfileView] = {}
        self.sessions: dict[str, SessionView] = {}
        self.live: dict[str, LiveRequest] = {}
        self.log: deque[LogLine] = deque(maxlen=LOG_LINES)
        self.seen: deque[str] = deque(maxlen=FINISHED_REQUESTS)
        self._seen_set: set[str] = set()
        self.requests_total = 0
        self.failed_total = 0
        self.dropped_events = 0
        self.live_text = False  # whether any request's text has arrived (the proxy was started to send it)
        self.policy_sources: tuple[str, ...] | None = None  # the base policy's files (None: not known yet)
        self._last_sample = 0.0

    # ---- snapshots -------------------------------------------------------------------------------------------
    def load_snapshot(self, payload: Mapping[str, Any], now: float) -> None:
        """The first event of the feed: profiles, live sessions' statistics and requests in flight."""
        for p in payload.get("profiles") or []:
            self._profile_info(p)
        for s in payload.get("sessions") or []:
            view = self._session(str(s.get("session_id")), str(s.get("project") or "default"))
            view.est_copyability = _float(s.get("est_accepted_share_ewma"))
            view.stats_turns = _int(s.get("turns"))
            view.last_active = max(view.last_active, _float(s.get("last_seen")) or 0.0)
        for started in payload.get("in_flight") or []:
            self._started(started, now)

    def load_requests(self, records: Iterable[Mapping[str, Any]]) -> int:
        """Records from /adaptive/requests (oldest first); ones already folded in are skipped. Returns how many
        were new."""
        new = 0
        for record in records:
            if self._finish(record, from_history=True):
                new += 1
        return new

    def load_route(self, route: Mapping[str, Any]) -> None:
        """From /adaptive/route: the policy's sources and the sessions pinned before the view connected."""
        sources = _mapping(route.get("policy")).get("sources")
        if isinstance(sources, list):
            self.policy_sources = tuple(str(s) for s in sources)
        for session_id, profile in _mapping(route.get("pins")).items():
            self._session(str(session_id), "default").pinned = str(profile)

    def _profile_info(self, p: Mapping[str, Any]) -> None:
        view = self.profiles.setdefault(str(p.get("name")), ProfileView(str(p.get("name"))))
        view.base_url = str(p.get("base_url") or view.base_url)
        view.up = bool(p.get("up", True))
        view.reason = p.get("reason")
        view.model = p.get("model") or view.model
        types = p.get("spec_types")
        if isinstance(types, list | tuple):
            view.spec_types = tuple(str(t) for t in types)
        elif isinstance(types, str):
            view.spec_types = tuple(types.split(","))
        view.n_ctx = p.get("n_ctx") if isinstance(p.get("n_ctx"), int) else view.n_ctx
        view.slots = p.get("slots") if isinstance(p.get("slots"), int) else view.slots
        view.default = bool(p.get("default", view.default))
        replicas_view.from_snapshot(view.replicas, p.get("replicas"))

    def _session(self, session_id: str, project: str) -> SessionView:
        view = self.sessions.get(session_id)
        if view is None:
            view = self.sessions[session_id] = SessionView(session_id, project)
        return view

    def _profile(self, name: str) -> ProfileView:
        return self.profiles.setdefault(name, ProfileView(name))

    # ---- events ----------------------------------------------------------------------------------------------
    def apply(self, kind: str, payload: Mapping[str, Any], now: float) -> None:
        """`now` is when the event arrived: the live windows run on it (the proxy's clock may differ from the
        viewer's, and a replay runs on its own), while the log shows the event's own time."""
        at = _float(payload.get("at_unix")) or now
        if kind == "snapshot":
            self.load_snapshot(payload, now)
        elif kind == "RequestStarted":
            self._started(payload, at)
        elif kind == "DraftProgress":
            self._progress(payload, now)
        elif kind in ("RequestFinished", "RequestFailed"):
            record = payload.get("record")
            if isinstance(record, Mapping):
                self._finish(record, at=at, arrived=now)
        elif kind == "SessionUpdated":
            self._session_updated(payload, at)
        elif kind in ("ProfileUp", "ProfileDown"):
            self._profile_health(kind, payload, at)
        elif kind == "HandoffDone":
            self._handoff(payload, at)
        elif kind == "RemotePrefillDone":
            self.note(at, "handoff", _short(payload.get("session_id") or None), remote_prefill_line(payload))
        elif kind == "SessionPinned":
            view = self._session(str(payload.get("session_id")), "default")
            view.pinned = payload.get("profile")
            what = f"pinned to {view.pinned}" if view.pinned else "back to automatic routing"
            self.note(at, "note", _short(view.session_id), what + " (from its next turn)")
        elif kind == "PolicyChanged":
            self.note(at, "policy", "policy", str(payload.get("message")))
        elif kind == "EventsDropped":
            self.dropped_events += _int(payload.get("count"))
            self.note(at, "note", "feed", f"{_int(payload.get('count'))} events dropped; resyncing from history")

    def note(self, at: float, kind: str, who: str, text: str) -> None:
        self.log.append(LogLine(at, kind, who, text))

    def _started(self, p: Mapping[str, Any], at: float) -> None:
        rid = str(p.get("request_id"))
        if rid in self._seen_set or rid in self.live:
            return
        sid = p.get("session_id")
        profile = str(p.get("profile"))
        self.live[rid] = LiveRequest(rid, sid, profile, at)
        self._profile(profile).in_flight.add(rid)
        replicas_view.started(self._profile(profile).replicas, p, rid)
        if sid:
            view = self._session(str(sid), str(p.get("project") or "default"))
            view.client = client_of(p.get("session_source"), p.get("client")) if view.client == "?" else view.client
            view.profile, view.in_flight, view.last_active = profile, rid, at
            view.last_reason = p.get("reason") or view.last_reason
        reason = p.get("reason")
        self.note(at, "start", _short(sid), f"→ {profile}" + (f"  {reason}" if reason else ""))

    def _progress(self, p: Mapping[str, Any], at: float) -> None:
        live = self.live.get(str(p.get("request_id")))
        if live is None:
            return
        predicted, accepted = _int(p.get("predicted_n")), _int(p.get("draft_n_accepted"))
        self._profile(live.profile).add_output(at, predicted - live.predicted_n, accepted - live.draft_n_accepted)
        live.predicted_n, live.draft_n, live.draft_n_accepted = predicted, _int(p.get("draft_n")), accepted
        live.tokens_per_s = _float(p.get("predicted_per_second")) or live.tokens_per_s
        segments = p.get("text")
        if isinstance(segments, list):
            self.live_text = True
            live.add_text((str(s[0]), bool(s[1])) for s in segments if isinstance(s, list | tuple) and len(s) == 2)

    def _finish(
        self,
        record: Mapping[str, Any],
        *,
        at: float | None = None,
        arrived: float | None = None,
        from_history: bool = False,
    ) -> bool:
        rid = str(record.get("request_id"))
        if rid in self._seen_set:
            return False
        if len(self.seen) == self.seen.maxlen:
            self._seen_set.discard(self.seen[0])
        self.seen.append(rid)
        self._seen_set.add(rid)
        row = _turn_row(record)
        at = at if at is not None else (row.started_at_unix + (_float(record.get("total_ms")) or 0.0) / 1000)
        live = self.live.pop(rid, None)
        profile = self._profile(row.profile)
        profile.in_flight.discard(rid)
        if not from_history:  # the part of the output no progress event announced yet
            before = (live.predicted_n, live.draft_n_accepted) if live else (0, 0)
            when = arrived if arrived is not None else at
            profile.add_output(when, row.predicted_n - before[0], row.draft_n_accepted - before[1])
        profile.requests += 1
        profile.predicted_n += row.predicted_n
        profile.draft_n += row.draft_n
        profile.draft_n_accepted += row.draft_n_accepted
        replicas_view.finished(profile.replicas, record, rid, row.predicted_n, row.draft_n_accepted)
        profile.predicted_ms += _float(_mapping(record.get("timings")).get("predicted_ms")) or 0.0
        self.requests_total += 1
        self.failed_total += row.outcome != "finished"
        sid = record.get("session_id")
        if sid:
            view = self._session(str(sid), str(record.get("project") or "default"))
            if view.client == "?":
                view.client = client_of(record.get("session_source"), record.get("client"))
            view.turns.append(row)
            view.profile = row.profile
            view.last_reason = row.reason or view.last_reason
            view.last_active = max(view.last_active, at)
            if view.in_flight == rid:
                view.in_flight = None
            if live is not None and live.text:
                view.last_text = live
        if not from_history:
            self._log_finish(row, sid, at)
        return True

    def _log_finish(self, row: TurnRow, sid: Any, at: float) -> None:
        who = _short(sid)
        if row.outcome != "finished":
            self.note(at, "fail", who, f"✗ {row.status} {row.error or 'failed'}")
            return
        text = f"✓ {row.predicted_n} tok"
        if row.draft_n:
            share = f" ({row.draft_n_accepted / row.predicted_n:.0%})" if row.predicted_n else ""
            text += f", {row.draft_n_accepted} from drafts{share}"
        if row.tokens_per_s:
            text += f", {row.tokens_per_s:.1f} tok/s"
        if row.ttst_ms is not None:
            text += f", TTST {row.ttst_ms:.0f} ms"
        self.note(at, "finish", who, text + f" on {row.profile}")

    def _session_updated(self, p: Mapping[str, Any], at: float) -> None:
        sid = str(p.get("session_id"))
        view = self._session(sid, str(p.get("project") or "default"))
        view.est_copyability = _float(p.get("est_accepted_share_ewma"))
        turn = _mapping(p.get("turn"))
        view.stats_turns = max(view.stats_turns, _int(turn.get("turn")))
        est = _float(turn.get("est_accepted_share"))
        rid = p.get("request_id")
        rows = [t for t in view.turns if t.request_id == rid] if rid else []
        if not rows:  # statistics are folded in arrival order: the oldest turn still without an estimate
            rows = [t for t in view.turns if t.est_accepted_share is None and t.predicted_n][:1]
        for row in rows:
            row.est_accepted_share = est

    def _profile_health(self, kind: str, p: Mapping[str, Any], at: float) -> None:
        name = str(p.get("profile"))
        view = self._profile(name)
        up = kind == "ProfileUp"
        view.up = replicas_view.health(view.replicas, p, up)
        view.reason = None if view.up else str(p.get("reason"))
        who = f"{name}#{replicas_view.index_of(p)}" if len(view.replicas) > 1 else name
        if len(view.replicas) <= 1:
            view.base_url = str(p.get("base_url") or view.base_url)
        self.note(at, "profile", who, "up" if up else f"down: {p.get('reason')}")

    def _handoff(self, p: Mapping[str, Any], at: float) -> None:
        ends = [(p.get("from_profile"), _int(p.get("from_replica"))), (p.get("to_profile"), _int(p.get("to_replica")))]
        moved = " → ".join(f"{name}#{r}" if r else str(name) for name, r in ends)  # replica #0 (or no pool): the name
        if p.get("ok"):
            ms = ((_float(p.get("save_s")) or 0.0) + (_float(p.get("restore_s")) or 0.0)) * 1000
            text = f"KV handed over {moved}: {_int(p.get('tokens')):,} tok in {ms:.0f} ms"
        else:
            text = f"KV handoff {moved} failed ({p.get('error')}); re-prefills"
        self.note(at, "handoff", _short(str(p.get("session_id"))), text)

    # ---- clock -----------------------------------------------------------------------------------------------
    def tick(self, now: float) -> bool:
        """Closes the chart's seconds up to `now`; True when a point was added."""
        if self._last_sample == 0.0:
            self._last_sample = now
            return False
        added = False
        while now - self._last_sample >= 1.0:
            self._last_sample += 1.0
            for view in self.profiles.values():
                view.sample(self._last_sample)
            added = True
        if now - self._last_sample > CHART_SECONDS:  # a long pause (replay jump, suspended laptop)
            self._last_sample = now
        return added


def _turn_row(record: Mapping[str, Any]) -> TurnRow:
    timings = _mapping(record.get("timings"))
    handoff = record.get("handoff") if isinstance(record.get("handoff"), Mapping) else None
    handoff_ms = None
    if handoff is not None:
        handoff_ms = ((_float(handoff.get("save_s")) or 0.0) + (_float(handoff.get("restore_s")) or 0.0)) * 1000
    return TurnRow(
        request_id=str(record.get("request_id")),
        started_at_unix=_float(record.get("started_at_unix")) or 0.0,
        profile=str(record.get("profile")),
        api=str(record.get("api")),
        outcome=str(record.get("outcome") or "finished"),
        status=_int(record.get("status")),
        error=record.get("error"),
        prompt_n=_int(timings.get("prompt_n")),
        cache_n=_int(timings.get("cache_n")),
        predicted_n=_int(timings.get("predicted_n")),
        draft_n=_int(timings.get("draft_n")),
        draft_n_accepted=_int(timings.get("draft_n_accepted")),
        tokens_per_s=_float(timings.get("predicted_per_second")),
        ttft_ms=_float(record.get("ttft_ms")),
        ttst_ms=_float(record.get("ttst_ms")),
        route=record.get("route"),
        reason=record.get("reason"),
        moved_from=record.get("moved_from"),
        handoff_tokens=_int(handoff.get("tokens")) if handoff else None,
        handoff_ms=handoff_ms,
        handoff_ok=bool(handoff.get("ok")) if handoff else False,
    )


def remote_prefill_line(p: Mapping[str, Any]) -> str:
    """One log line for a remote prefill (`serve --pp-server`): what came back and how long each step took."""
    if not p.get("ok"):
        return f"remote prefill failed ({p.get('reason')}: {p.get('error')}); prefilled here"
    steps = " · ".join(
        f"{name} {(_float(p.get(key)) or 0.0) * 1000:.0f} ms"
        for name, key in (("prefill", "remote_prefill_s"), ("transfer", "transfer_s"), ("restore", "restore_s"))
    )
    megabytes = _int(p.get("bytes")) / 1e6
    return f"remote prefill: {_int(p.get('tokens')):,} tok, {megabytes:,.1f} MB back to {p.get('profile')} ({steps})"
