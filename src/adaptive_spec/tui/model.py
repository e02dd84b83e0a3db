"""The TUI's picture of the proxy: a pure fold of feed events and HTTP snapshots into profiles, sessions and the log.

No Textual and no HTTP here, so the picture is tested on its own and is the same whether the events come from a live
proxy or a replayed trace. Every figure of drafted and accepted tokens is summed from the request records, which carry
llama-server's own `timings`; the live 1-second figures come from the draft progress events in between.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from adaptive_spec.telemetry import decoding, events
from adaptive_spec.tui import log_lines, pools
from adaptive_spec.tui.log_lines import LogLine
from adaptive_spec.tui.profiles import CHART_SECONDS, ProfileView
from adaptive_spec.tui.sessions import LiveRequest, SessionView, client_of, number, turn_row, whole

LOG_LINES = 500
FINISHED_REQUESTS = 5000  # request ids remembered to drop duplicates between the history and the feed


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


class Dashboard:
    """Everything the screens show. `apply` takes one feed event (as `events.decode_event` reads it); the caller
    passes the clock (`now`), so a replay runs on its own time."""

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
            self.profile(str(p.get("name"))).read_profile(p)
        for s in payload.get("sessions") or []:
            view = self._session(str(s.get("session_id")), str(s.get("project") or "default"))
            view.est_copyability = number(s.get("est_accepted_share_ewma"))
            view.stats_turns = whole(s.get("turns"))
            view.last_active = max(view.last_active, number(s.get("last_seen")) or 0.0)
        for item in payload.get("in_flight") or []:
            started = decoding.decode_event("RequestStarted", _mapping(item))
            if isinstance(started, events.RequestStarted):
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

    def _session(self, session_id: str, project: str) -> SessionView:
        view = self.sessions.get(session_id)
        if view is None:
            view = self.sessions[session_id] = SessionView(session_id, project)
        return view

    def profile(self, name: str) -> ProfileView:
        return self.profiles.setdefault(name, ProfileView(name))

    # ---- events ----------------------------------------------------------------------------------------------
    def apply(self, event: events.Event, now: float) -> None:
        """`now` is when the event arrived: the live windows run on it (the proxy's clock may differ from the
        viewer's, and a replay runs on its own), while the log shows the event's own time."""
        at = event.at_unix or now
        match event:
            case events.RequestStarted():
                self._started(event, at)
            case events.DraftProgress():
                self._progress(event, now)
            case events.RequestFinished() | events.RequestFailed():
                if event.record:  # a message without one (a bad line of a recording) has nothing to fold in
                    self._finish(event.record, at=at, arrived=now)
            case events.RequestCounted():
                self._counted(event.record)
            case events.SessionUpdated():
                self._session_updated(event)
            case events.ProfileUp():
                self.note(at, "profile", self.profile(event.profile).health(event), "up")
            case events.ProfileDown():
                self.note(at, "profile", self.profile(event.profile).health(event), f"down: {event.reason}")
            case events.HandoffDone():
                self.note(at, "handoff", log_lines.short(event.session_id), log_lines.handoff(event))
            case events.RemotePrefillDone():
                self.note(at, "handoff", log_lines.short(event.session_id), log_lines.remote_prefill(event))
            case events.SessionPinned():
                self._session(event.session_id, "default").pinned = event.profile
                self.note(at, "note", log_lines.short(event.session_id), log_lines.pinned(event.profile))
            case events.PolicyChanged():
                self.note(at, "policy", "policy", event.message)
            case events.EventsDropped():
                self.dropped_events += event.count
                self.note(at, "note", "feed", f"{event.count} events dropped; resyncing from history")

    def note(self, at: float, kind: str, who: str, text: str) -> None:
        self.log.append(LogLine(at, kind, who, text))

    def _started(self, event: events.RequestStarted, at: float) -> None:
        rid, sid, profile = event.request_id, event.session_id, event.profile
        if rid in self._seen_set or rid in self.live:
            return
        self.live[rid] = LiveRequest(rid, sid, profile, at)
        self.profile(profile).in_flight.add(rid)
        pools.replica(self.profile(profile).replicas, event.replica).in_flight.add(rid)
        if sid:
            view = self._session(sid, event.project or "default")
            view.client = client_of(event.session_source, event.client) if view.client == "?" else view.client
            view.profile, view.in_flight, view.last_active = profile, rid, at
            view.last_reason = event.reason or view.last_reason
        self.note(at, "start", log_lines.short(sid), log_lines.started(event))

    def _progress(self, event: events.DraftProgress, at: float) -> None:
        live = self.live.get(event.request_id)
        if live is None:
            return
        predicted, accepted = event.predicted_n, event.draft_n_accepted
        self.profile(live.profile).add_output(at, predicted - live.predicted_n, accepted - live.draft_n_accepted)
        live.predicted_n, live.draft_n, live.draft_n_accepted = predicted, event.draft_n, accepted
        live.tokens_per_s = event.predicted_per_second or live.tokens_per_s
        if event.text is not None:
            self.live_text = True
            live.add_text(event.text)

    def _finish(
        self,
        record: Mapping[str, Any],
        *,
        at: float | None = None,
        arrived: float | None = None,
        from_history: bool = False,
    ) -> bool:
        rec = decoding.decode_record(record)
        rid = rec.request_id
        if rid in self._seen_set:
            return False
        if len(self.seen) == self.seen.maxlen:
            self._seen_set.discard(self.seen[0])
        self.seen.append(rid)
        self._seen_set.add(rid)
        row = turn_row(rec)
        at = at if at is not None else (row.started_at_unix + rec.total_ms / 1000)
        live = self.live.pop(rid, None)
        profile = self.profile(row.profile)
        profile.in_flight.discard(rid)
        if not from_history:  # the part of the output no progress event announced yet
            before = (live.predicted_n, live.draft_n_accepted) if live else (0, 0)
            when = arrived if arrived is not None else at
            profile.add_output(when, row.predicted_n - before[0], row.draft_n_accepted - before[1])
        profile.count(row.predicted_n, row.draft_n_accepted)
        profile.draft_n += row.draft_n
        replica = rec.replica
        pools.finished(profile.replicas, replica, rid, row.predicted_n, row.draft_n_accepted)
        profile.predicted_ms += row.predicted_ms
        self.requests_total += 1
        self.failed_total += row.outcome != "finished"
        sid = rec.session_id
        if sid:
            view = self._session(str(sid), rec.project or "default")
            if view.client == "?":
                view.client = client_of(rec.session_source, rec.client)
            view.turns.append(row)
            view.profile = row.profile
            view.last_reason = row.reason or view.last_reason
            view.last_active = max(view.last_active, at)
            if view.in_flight == rid:
                view.in_flight = None
            if live is not None and live.text:
                view.last_text = live
        if not from_history:
            kind, text = log_lines.finished(row)
            self.note(at, kind, log_lines.short(sid), text)
        return True

    def _counted(self, record: Mapping[str, Any]) -> None:
        """A finished request's record counted again by llama-server's counters: its turn's figures replaced (the
        turn keeps the estimate the statistics gave it)."""
        rec = decoding.decode_record(record)
        new = turn_row(rec)
        for view in self.sessions.values():
            for i, row in enumerate(view.turns):
                if row.request_id == rec.request_id:
                    new.est_accepted_share = row.est_accepted_share
                    view.turns[i] = new
                    return

    def _session_updated(self, event: events.SessionUpdated) -> None:
        view = self._session(event.session_id, event.project or "default")
        view.est_copyability = event.est_accepted_share_ewma
        view.stats_turns = max(view.stats_turns, whole(event.turn.get("turn")))
        est = number(event.turn.get("est_accepted_share"))
        rid = event.request_id
        rows = [t for t in view.turns if t.request_id == rid] if rid else []
        if not rows:  # statistics are folded in arrival order: the oldest turn still without an estimate
            rows = [t for t in view.turns if t.est_accepted_share is None and t.predicted_n][:1]
        for row in rows:
            row.est_accepted_share = est

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
