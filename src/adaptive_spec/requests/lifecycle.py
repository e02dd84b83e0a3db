"""The request lifecycle: one request's own state while the proxy handles it, its announcement, its live draft progress
and its end.

The one owner of "every request ends with exactly one record and one finished-or-failed event" (and the router's load
coming down, the session learning from it, the trace line).

A request's state is values, each made once by the stage that decides it (`ProxyRequest` refuses a second write),
and two running tallies, each written by one owner because it changes as the answer comes: the sending stage's
`Forwards` (the meter an answer fills chunk by chunk, the counts of answers not seen to their end) and, here, the time
each request's draft progress was last published (throttling the live view's events)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from adaptive_spec.llama.upstreams import Upstream
from adaptive_spec.requests.accounting import HOLD_S, Accounting, with_counts
from adaptive_spec.requests.apis import traits
from adaptive_spec.requests.body.parse import ParsedRequest, RoutedPath
from adaptive_spec.requests.body.values import Prepared, Received, Rewrite
from adaptive_spec.requests.forwarding.outcome import Outcome
from adaptive_spec.requests.forwarding.sent import Forwards, Sent
from adaptive_spec.requests.gemini.request import GeminiCall
from adaptive_spec.routing.contract import Completion, Refusal, Route
from adaptive_spec.routing.decision import Decision
from adaptive_spec.routing.router import Router
from adaptive_spec.sessions.agents.client_limits import wait_note
from adaptive_spec.sessions.grouping import SessionAssignment
from adaptive_spec.sessions.project import DEFAULT_PROJECT
from adaptive_spec.sessions.service import SessionService
from adaptive_spec.shared_state.shell import SharedState
from adaptive_spec.streams.meter import ResponseMeter
from adaptive_spec.telemetry.bus import EventBus
from adaptive_spec.telemetry.events import (
    DraftProgress,
    RequestCounted,
    RequestFailed,
    RequestFinished,
    RequestStarted,
)
from adaptive_spec.telemetry.history import RequestHistory
from adaptive_spec.telemetry.ledger import Counts
from adaptive_spec.telemetry.records import RequestRecord, Timings
from adaptive_spec.telemetry.trace import TraceWriter

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Routed:
    """Where a request goes, made once by the stage that chooses it: the upstream (one server of its profile's pool),
    how many servers that pool has, and the router's route (None: a request that does not generate, sent to the
    profile it names; a route completed before a failover routes it again)."""

    upstream: Upstream
    pool_size: int = 1
    route: Route | None = None


# Values made once by their stage: written a second time, a stage would be patching another's value.
_ONCE = frozenset({"received", "prepared", "rewrite", "refusal"})


@dataclass(slots=True)
class ProxyRequest:
    """One request's own state while it is handled (never shared between tasks): what it is (its id, path, the
    profile it names, its client), then one value per stage, each made once by the stage that decides it: what the
    proxy received (`received`: its body, a Gemini call's translation) and read of it (`prepared`), the body sent
    instead (`rewrite`), where it went (`to`, a `Routed`: one per forward, a failover's new one) or why not
    (`refusal`). How it ended is the `Outcome` its lifecycle's `finish` is given.

    Two things are running tallies, not values, each written by one owner alone: `forwards`, the sending stage's
    (requests/forwarding/sent.py: the last forward's `Sent` body, the meter its answer fills chunk by chunk, the
    counts of answers not seen to their end), and the time of the last draft progress published, which the lifecycle
    keeps in a table of its own (`RequestLifecycle.progress`), since only it publishes progress."""

    request_id: str
    routed: RoutedPath
    named: str  # the profile its header names, else the default: what it is sent to unless routed elsewhere
    started: float = field(default_factory=time.perf_counter)
    started_unix: float = field(default_factory=time.time)
    client: str | None = None  # the agent, from its User-Agent
    received: Received | None = None  # None: no body read (yet)
    prepared: Prepared | None = None  # a generating request, once parsed and grouped
    rewrite: Rewrite | None = None  # None: the client's body is what goes upstream
    to: Routed | None = None  # its route is counted in the router's load until it is completed
    refusal: Refusal | None = None  # the router could not route it
    forwards: Forwards = field(default_factory=Forwards)

    def __setattr__(self, name: str, value: object) -> None:
        if name in _ONCE and getattr(self, name, None) is not None:
            raise AttributeError(f"request {self.request_id}: its {name} is a value made once, not rewritten")
        object.__setattr__(self, name, value)

    @property
    def body(self) -> bytes:
        """The body as it stands for the request (`received`: a translated request's is its chat completion's)."""
        return self.received.body if self.received is not None else b""

    @property
    def gemini(self) -> GeminiCall | None:
        """A Gemini request, sent as a chat completion: what it asked for."""
        return self.received.gemini if self.received is not None else None

    @property
    def meter(self) -> ResponseMeter:
        """The meter of its last forward's answer (the sending stage's: `forwards`)."""
        return self.forwards.meter

    @property
    def sent(self) -> Sent | None:
        return self.forwards.sent

    @property
    def parsed(self) -> ParsedRequest | None:
        return self.prepared.parsed if self.prepared is not None else None

    @property
    def assignment(self) -> SessionAssignment | None:
        return self.prepared.assignment if self.prepared is not None else None

    @property
    def workspace(self) -> str | None:
        return self.prepared.workspace if self.prepared is not None else None

    @property
    def project(self) -> str:
        """Its session's project; before it is grouped (or for a request that is not), its path's or the default."""
        return self.prepared.project if self.prepared is not None else self.routed.project or DEFAULT_PROJECT

    @property
    def route(self) -> Route | None:
        return self.to.route if self.to is not None else None

    @property
    def profile(self) -> str:
        """The profile it went to: a refusal's decision's, else its upstream's, else the one it names."""
        if self.refusal is not None and self.refusal.decision is not None:
            return self.refusal.decision.profile
        return self.to.upstream.name if self.to is not None else self.named

    @property
    def replica(self) -> int:
        """Which server of its profile's pool it was sent to."""
        return self.to.upstream.replica if self.to is not None else 0

    @property
    def pool_size(self) -> int:
        return self.to.pool_size if self.to is not None else 1

    @property
    def decision(self) -> Decision | None:
        if self.route is not None:
            return self.route.decision
        return self.refusal.decision if self.refusal is not None else None

    @property
    def slot(self) -> int | None:
        """The slot named with id_slot (profiles with several slots)."""
        return self.route.slot if self.route is not None else None


class RequestLifecycle:
    """Announces, follows and ends requests, publishing on the bus it is given."""

    def __init__(
        self,
        bus: EventBus,
        history: RequestHistory,
        router: Router,
        sessions: SessionService | None,
        trace: TraceWriter | None,
        progress_interval_s: float,
        shared: SharedState | None = None,
    ) -> None:
        """`shared`: the state this proxy shares with others (`serve --shared-state`), written after each request."""
        self.bus, self.history, self.router, self.sessions, self.trace = bus, history, router, sessions, trace
        self.shared = shared
        self.progress_interval_s = progress_interval_s
        self.in_flight: dict[str, RequestStarted] = {}  # announced, not ended: the feed's snapshot lists them
        # When each request's draft progress was last published, and its timings then: the running tally `progress`
        # keeps alone (a request's entry goes with its record).
        self._progressed: dict[str, tuple[float, Timings | None]] = {}
        self.handlers: dict[str, asyncio.Task[object]] = {}  # every request being handled, for the shutdown
        self.stopping = False  # the shutdown grace is over: requests still running are being ended
        self.accounting = Accounting()  # what llama-server counted for answers not seen to their end
        self._settling: set[asyncio.Task[None]] = set()  # records held until those counts are known

    async def drain(self, grace_s: float) -> int:
        """On shutdown: let requests in flight run for up to `grace_s`, then end the rest (each answers 503, or ends
        its stream with a final error event: see `forward`). Returns how many were ended."""
        if self.handlers:
            await asyncio.wait(set(self.handlers.values()), timeout=grace_s)
        self.stopping = True
        left = list(self.handlers.values())
        for task in left:
            task.cancel("adaptive-spec is shutting down")
        if left:
            await asyncio.wait(left, timeout=5.0)
        await self.accounting.close()  # the held records go out with what their streams showed
        if self._settling:
            await asyncio.wait(set(self._settling), timeout=5.0)
        return len(left)

    def announce(self, req: ProxyRequest) -> None:
        """RequestStarted, once: when the request is forwarded, or at its end if it never was."""
        if req.request_id in self.in_flight:
            return
        assignment, decision = req.assignment, req.decision
        started = RequestStarted(
            request_id=req.request_id,
            api=req.routed.api,
            project=req.project,
            profile=req.profile,
            session_id=assignment.session_id if assignment else None,
            session_source=assignment.source if assignment else None,
            stream=req.parsed.stream if req.parsed else False,
            route=decision.kind if decision else None,
            reason=decision.reason if decision else None,
            moved_from=decision.moved_from if decision else None,
            client=req.client,
            replica=req.replica,
        )
        self.in_flight[req.request_id] = started
        self.bus.publish(started)

    @property
    def watched(self) -> bool:
        """A live view is subscribed to the events (only it shows the draft progress)."""
        return self.bus.subscribers > 0

    def progress(self, req: ProxyRequest, *, last_one: bool = False) -> None:
        """After each relayed chunk: publish the running draft totals, at most once per interval (and, with live
        text on, once more at the end, so the feed carries the whole answer)."""
        last_at, last = self._progressed.get(req.request_id, (0.0, None))
        now = time.monotonic()
        if not last_one and (now - last_at < self.progress_interval_s or not self.watched):
            return  # before reading the timings: that reads the stream's bytes since the last time
        timings = req.meter.timings
        if timings is None or timings is last:
            return
        self._progressed[req.request_id] = (now, timings)
        self.bus.publish(
            DraftProgress(
                request_id=req.request_id,
                profile=req.profile,
                predicted_n=timings.predicted_n,
                draft_n=timings.draft_n,
                draft_n_accepted=timings.draft_n_accepted,
                predicted_per_second=timings.predicted_per_second,
                text=req.meter.live.take() if req.meter.live is not None else None,
            )
        )

    def finish(self, method: str, path: str, req: ProxyRequest, outcome: Outcome) -> None:
        """The request's end, however it went (`outcome`): the profile's load comes down first, a session learns from
        a request served in full, then exactly one record goes to the history, the bus and the trace."""
        self._learn(req, outcome.finished)
        record = _record(method, path, req, outcome)
        as_json = record.to_json()
        self._publish(req, record, as_json, outcome.finished)
        self._trace(req, as_json)
        if req.forwards.unseen:  # counted again once llama-server's counters say what it did for the request
            task = asyncio.get_running_loop().create_task(self._counted(req, record))
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)

    async def _counted(self, req: ProxyRequest, record: RequestRecord) -> None:
        try:
            counts = await asyncio.wait_for(asyncio.gather(*req.forwards.unseen), HOLD_S + 5.0)
        except TimeoutError:
            return
        if any(c is None for c in counts):
            return  # not told apart from other requests: the record keeps what the answer showed
        total = sum((c for c in counts if c is not None), Counts())
        counted = replace(record, timings=with_counts(record.timings, total))
        self.history.replace(counted)
        before = record.to_json().get("timings") or {}
        self.bus.publish(RequestCounted(record=counted.to_json(), before=before))

    def _learn(self, req: ProxyRequest, finished: bool) -> None:
        """The router's load comes down whatever happened (`complete`); a request served in full is learned from,
        by the router and by the session's statistics."""
        meter, assignment = req.meter, req.assignment
        line_moved = False
        if req.route is not None:
            done = Completion(finished, meter.timings, meter.output.text, meter.output.kept_share())
            line_moved = self.router.complete(req.route, done)
        if self.shared is not None:  # its booking goes; what it served is written for the other proxies
            self.shared.ended(
                self.router,
                req.request_id,
                req.route,
                (meter.output.text, meter.output.tool_call_ids) if finished else None,
            )
        if self.sessions is None or assignment is None or req.parsed is None:
            return
        if not finished:
            self.sessions.unanswered(assignment, req.parsed.body)
        else:
            self.sessions.finished(
                assignment,
                req.project,
                req.parsed.body,
                meter.output,
                req.request_id,
                side=req.decision is not None and req.decision.side,
                line_moved=line_moved,
                body_bytes=len(req.body),
                raw_body=req.body,
            )

    def _publish(self, req: ProxyRequest, record: RequestRecord, as_json: dict[str, Any], finished: bool) -> None:
        """The record into the history, and its events: started (if it never was), the last live text, and one
        finished-or-failed."""
        self.history.add(record)
        self.announce(req)
        if req.meter.live is not None:
            self.progress(req, last_one=True)
        self.in_flight.pop(req.request_id, None)
        self._progressed.pop(req.request_id, None)
        self.bus.publish(RequestFinished(record=as_json) if finished else RequestFailed(record=as_json))

    def _trace(self, req: ProxyRequest, as_json: dict[str, Any]) -> None:
        trace = self.trace
        if trace is None or not traits(req.routed.api).generates:
            return
        try:
            trace.request(as_json, req.body, req.meter.output.text if trace.content else None)
        except (OSError, ValueError):
            log.exception("could not write the trace line for request %s", req.request_id)


def _record(method: str, path: str, req: ProxyRequest, outcome: Outcome) -> RequestRecord:
    assignment, decision, meter, route, finished = req.assignment, req.decision, req.meter, req.route, outcome.finished
    total_ms = (time.perf_counter() - req.started) * 1000.0
    return RequestRecord(
        request_id=req.request_id,
        started_at_unix=req.started_unix,
        method=method,
        path=path,
        api=req.routed.api,
        project=req.project,
        session_id=assignment.session_id if assignment else None,
        session_source=assignment.source if assignment else None,
        subagent=assignment.subagent if assignment else False,
        profile=req.profile,
        stream=req.parsed.stream if req.parsed is not None else False,
        status=outcome.status,
        outcome="finished" if finished else "failed",
        error=outcome.error,
        timings=meter.timings,
        ttft_ms=meter.first_token_ms,
        ttst_ms=meter.second_token_ms,
        total_ms=total_ms,
        route=decision.kind if decision else None,
        reason=decision.reason if decision else None,
        moved_from=decision.moved_from if decision else None,
        handoff=_handoff_record(route, meter.timings),
        remote_prefill=asdict(route.remote_prefill) if route is not None and route.remote_prefill is not None else None,
        client=req.client,
        new_tokens_est=decision.new_tokens if decision else None,
        side=decision.side if decision else False,
        replica=req.replica,
        replica_moved_from=decision.replica_moved_from if decision else None,
        speculation=req.sent.speculation if req.sent is not None else None,
        repeat_guard=req.rewrite.guard.describe() if req.rewrite is not None and req.rewrite.guard else None,
        repaired=req.rewrite.repaired if req.rewrite is not None else None,
        model=req.parsed.model if req.parsed is not None else None,
        not_honoured=", ".join(req.gemini.not_honoured) if req.gemini and req.gemini.not_honoured else None,
        time_estimate=_time_estimate(decision, meter.timings if finished else None),
        client_limit=wait_note(req.client, meter.first_token_ms if meter.first_token_ms is not None else total_ms),
    )


def _time_estimate(decision: Decision | None, timings: Timings | None) -> dict[str, Any] | None:
    estimate = decision.time_estimate(timings) if decision is not None else None
    return estimate.to_json() if estimate is not None else None


def _handoff_record(route: Route | None, timings: Timings | None) -> dict[str, Any] | None:
    """The KV handoff before this request, and what its prompt then reused of what was restored: `reused` is
    llama-server's `cache_n` (a restore can report success and still be re-prefilled whole: llama.cpp #26676, a
    hybrid target's recurrent state)."""
    if route is None or route.handoff is None:
        return None
    out = asdict(route.handoff)
    if route.handoff.ok and timings is not None and not timings.from_usage:
        out["reused"] = timings.cache_n
    return out
