"""Prometheus metrics of the proxy, fed from the event bus: per profile and project."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from adaptive_spec.telemetry.events import (
    Event,
    HandoffDone,
    PolicyChanged,
    ProfileDown,
    ProfileUp,
    RemotePrefillDone,
    RequestCounted,
    RequestFailed,
    RequestFinished,
)

_LABELS = ("profile", "project")
_REPLICA = ("profile", "replica")
MAX_PROJECT_LABELS = 100  # projects beyond this share the label "other": series are never freed
_SPEED_BUCKETS = (1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_PP_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 180, 600)
_PP_BYTES_BUCKETS = tuple(float(1 << n) for n in range(20, 38, 2))  # 1 MiB .. 128 GiB


class ProxyMetrics:
    """Counters follow Prometheus naming: `adaptive_spec_` prefix, `_total` counters, base units (seconds)."""

    def __init__(self, known_profiles: frozenset[str] = frozenset()) -> None:
        """Declares every metric (a list of declarations, hence its length)."""
        self.known_profiles = known_profiles
        self._projects: set[str] = set()
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "adaptive_spec_requests", "Requests by outcome", [*_LABELS, "api", "outcome"], registry=r
        )
        self.prompt_tokens = Counter(
            "adaptive_spec_prompt_tokens", "Prompt tokens processed (not cached)", _LABELS, registry=r
        )
        self.cached_tokens = Counter(
            "adaptive_spec_cached_prompt_tokens", "Prompt tokens reused from the KV cache", _LABELS, registry=r
        )
        self.predicted_tokens = Counter("adaptive_spec_predicted_tokens", "Output tokens", _LABELS, registry=r)
        self.draft_tokens = Counter("adaptive_spec_draft_tokens", "Drafted tokens (speculation)", _LABELS, registry=r)
        self.accepted_tokens = Counter(
            "adaptive_spec_draft_accepted_tokens", "Accepted drafted tokens", _LABELS, registry=r
        )
        self.errors = Counter("adaptive_spec_errors", "Failed requests by kind", [*_LABELS, "kind"], registry=r)
        self.decode_speed = Histogram(
            "adaptive_spec_decode_tokens_per_second",
            "Decode speed per request",
            _LABELS,
            buckets=_SPEED_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "adaptive_spec_time_to_first_token_seconds",
            "Time to first generated token",
            _LABELS,
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.decisions = Counter(
            "adaptive_spec_route_decisions",
            "Routing decisions by how the profile was chosen",
            ["profile", "route"],
            registry=r,
        )
        self.moves = Counter(
            "adaptive_spec_session_moves",
            "Requests whose session's KV lived on another profile",
            ["from_profile", "to_profile"],
            registry=r,
        )
        self.handoffs = Counter(
            "adaptive_spec_kv_handoffs", "KV slot handoffs (save + restore) by outcome", ["outcome"], registry=r
        )
        self._remote_prefill_metrics()
        self.policy_changes = Counter("adaptive_spec_policy_changes", "Policy files reloaded or found bad", registry=r)
        self.profile_up = Gauge("adaptive_spec_profile_up", "1 when the profile is serving", ["profile"], registry=r)
        self._replica_metrics(r)
        r.register(_LoopTasks())

    def _replica_metrics(self, r: CollectorRegistry) -> None:
        """Per server of a profile's pool (`replica` is its index in the pool; 0 for a profile of one server)."""
        self.replica_up = Gauge(
            "adaptive_spec_replica_up", "1 when the replica is serving", ["profile", "replica"], registry=r
        )
        # A down spell shorter than the scrape interval is missed by the gauge; the count of them is not.
        self.replica_downs = Counter(
            "adaptive_spec_replica_marked_down",
            "Times the replica was marked down (health poll, refused connection or its launcher)",
            _REPLICA,
            registry=r,
        )
        self.replica_requests = Counter(
            "adaptive_spec_replica_requests", "Requests by replica and outcome", [*_REPLICA, "outcome"], registry=r
        )
        self.replica_predicted = Counter(
            "adaptive_spec_replica_predicted_tokens", "Output tokens by replica", _REPLICA, registry=r
        )
        self.replica_drafted = Counter(
            "adaptive_spec_replica_draft_tokens", "Drafted tokens by replica", _REPLICA, registry=r
        )
        self.replica_accepted = Counter(
            "adaptive_spec_replica_draft_accepted_tokens", "Accepted drafted tokens by replica", _REPLICA, registry=r
        )
        self.replica_moves = Counter(
            "adaptive_spec_replica_moves",
            "Requests whose session's KV lived on another replica of the same profile",
            ["profile", "from_replica", "to_replica"],
            registry=r,
        )

    def _remote_prefill_metrics(self) -> None:
        r = self.registry
        self.pp_chosen = Counter(
            "adaptive_spec_remote_prefill_chosen", "Prompts the cost model sent to --pp-server", registry=r
        )
        self.pp_done = Counter(
            "adaptive_spec_remote_prefill_done", "Remote prefills whose KV was restored here", registry=r
        )
        self.pp_fallbacks = Counter(
            "adaptive_spec_remote_prefill_fallbacks",
            "Remote prefills given up (prefilled here instead) by reason",
            ["reason"],
            registry=r,
        )
        self.pp_bytes = Histogram(
            "adaptive_spec_remote_prefill_transfer_bytes",
            "Slot file bytes brought back",
            buckets=_PP_BYTES_BUCKETS,
            registry=r,
        )
        self.pp_seconds = Histogram(
            "adaptive_spec_remote_prefill_seconds",
            "Time of each remote prefill step (prefill, save, transfer, restore)",
            ["step"],
            buckets=_PP_SECONDS_BUCKETS,
            registry=r,
        )

    def _remote_prefill(self, event: RemotePrefillDone) -> None:
        self.pp_chosen.inc()
        if not event.ok:
            self.pp_fallbacks.labels(event.reason or "other").inc()
            return
        self.pp_done.inc()
        self.pp_bytes.observe(event.bytes)
        steps = {
            "prefill": event.remote_prefill_s,
            "save": event.save_s,
            "transfer": event.transfer_s,
            "restore": event.restore_s,
        }
        for step, seconds in steps.items():
            self.pp_seconds.labels(step).observe(seconds)

    def on_event(self, event: Event) -> None:
        if isinstance(event, RequestFinished | RequestFailed):
            self._record(event.record, failed=isinstance(event, RequestFailed))
        elif isinstance(event, RequestCounted):
            self._counted(event.record, event.before)
        elif isinstance(event, ProfileUp):
            self.profile_up.labels(event.profile).set(1)
            self.replica_up.labels(event.profile, str(event.replica)).set(1)
        elif isinstance(event, ProfileDown):
            # A profile with a pool stays up while one replica serves: its gauge is the table's (set by the app).
            self.profile_up.labels(event.profile).set(0 if event.profile_down else 1)
            self.replica_up.labels(event.profile, str(event.replica)).set(0)
            self.replica_downs.labels(event.profile, str(event.replica)).inc()
        elif isinstance(event, HandoffDone):
            self.handoffs.labels("ok" if event.ok else "failed").inc()
        elif isinstance(event, RemotePrefillDone):
            self._remote_prefill(event)
        elif isinstance(event, PolicyChanged):
            self.policy_changes.inc()

    def _record(self, record: dict[str, object], *, failed: bool) -> None:
        labels = (self._profile_label(str(record["profile"])), self._project_label(str(record["project"])))
        self._child(self.requests, *labels, str(record["api"]), "failed" if failed else "finished").inc()
        if failed:
            self._child(self.errors, *labels, _error_kind(record)).inc()
        self._replica_record(record, labels[0], failed=failed)
        route = record.get("route")
        if isinstance(route, str):
            self._child(self.decisions, labels[0], route).inc()
            moved = record.get("moved_from")
            if isinstance(moved, str):
                self._child(self.moves, self._profile_label(moved), labels[0]).inc()
        timings = record.get("timings")
        if isinstance(timings, dict):
            self._child(self.prompt_tokens, *labels).inc(int(timings.get("prompt_n", 0)))
            self._child(self.cached_tokens, *labels).inc(int(timings.get("cache_n", 0)))
            self._child(self.predicted_tokens, *labels).inc(int(timings.get("predicted_n", 0)))
            self._child(self.draft_tokens, *labels).inc(int(timings.get("draft_n", 0)))
            self._child(self.accepted_tokens, *labels).inc(int(timings.get("draft_n_accepted", 0)))
            speed = float(timings.get("predicted_per_second", 0.0))
            if speed > 0 and int(timings.get("predicted_n", 0)) > 1:
                self._child(self.decode_speed, *labels).observe(speed)
        ttft = record.get("ttft_ms")
        if isinstance(ttft, int | float):
            self._child(self.ttft, *labels).observe(ttft / 1000.0)

    def _counted(self, record: dict[str, object], before: dict[str, object]) -> None:
        """What llama-server counted beyond what the request's first record said (counters only go up)."""
        labels = (self._profile_label(str(record["profile"])), self._project_label(str(record["project"])))
        timings = record.get("timings")
        if not isinstance(timings, dict):
            return
        for metric, name in (
            (self.prompt_tokens, "prompt_n"),
            (self.cached_tokens, "cache_n"),
            (self.predicted_tokens, "predicted_n"),
            (self.draft_tokens, "draft_n"),
            (self.accepted_tokens, "draft_n_accepted"),
        ):
            added = int(timings.get(name, 0)) - int(before.get(name, 0))  # type: ignore[call-overload]
            if added > 0:
                self._child(metric, *labels).inc(added)

    def _replica_record(self, record: dict[str, object], profile: str, *, failed: bool) -> None:
        replica = str(record.get("replica") or 0)
        self._child(self.replica_requests, profile, replica, "failed" if failed else "finished").inc()
        moved = record.get("replica_moved_from")
        if isinstance(moved, int):
            self._child(self.replica_moves, profile, str(moved), replica).inc()
        timings = record.get("timings")
        if isinstance(timings, dict):
            self._child(self.replica_predicted, profile, replica).inc(int(timings.get("predicted_n", 0)))
            self._child(self.replica_drafted, profile, replica).inc(int(timings.get("draft_n", 0)))
            self._child(self.replica_accepted, profile, replica).inc(int(timings.get("draft_n_accepted", 0)))

    def _child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, remembered: every request's end counts into a dozen labelled series, and
        prometheus_client's lookup takes a lock and builds its key each time. Label values are bounded (profiles,
        projects up to MAX_PROJECT_LABELS, APIs, outcomes, replicas), so is this."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def _profile_label(self, profile: str) -> str:
        # A pin naming no profile (answered 400) must not mint a new series per made-up name.
        return profile if not self.known_profiles or profile in self.known_profiles else "unknown"

    def _project_label(self, project: str) -> str:
        if project in self._projects or len(self._projects) < MAX_PROJECT_LABELS:
            self._projects.add(project)
            return project
        return "other"

    def watch_session_updates(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """Count the session statistics updates (processed, coalesced, dropped) from their owner, read at scrape."""
        self.registry.register(
            _Counts("adaptive_spec_session_updates", "Session statistics updates by outcome", "outcome", counts)
        )

    def watch_heads(self, counts: Callable[[], Mapping[str, int]]) -> None:
        """The head store's operations (saved, restored, warm_started, failed, ...), read from it at scrape."""
        self.registry.register(
            _Counts("adaptive_spec_heads", "Warm starts: the head store's operations by outcome", "outcome", counts)
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Counts(Collector):
    """Counters owned elsewhere (a service's own dict of counts), one series per label value, read at scrape."""

    def __init__(self, name: str, doc: str, label: str, counts: Callable[[], Mapping[str, int]]) -> None:
        self._name, self._doc, self._label, self._counts = name, doc, label, counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(self._name, self._doc, labels=[self._label])
        for value, count in self._counts().items():
            family.add_metric([value], count)
        yield family


class _LoopTasks(Collector):
    """The asyncio tasks alive, counted at each scrape on the loop that serves it (the proxy's own): a figure that
    climbs while nothing is in flight is work that outlived its request."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            tasks = len(asyncio.all_tasks())
        except RuntimeError:  # rendered outside an event loop (a unit test's render): there is no such figure
            return
        yield GaugeMetricFamily(
            "adaptive_spec_event_loop_tasks", "asyncio tasks alive in the proxy's event loop", value=tasks
        )


def _error_kind(record: dict[str, object]) -> str:
    status = record.get("status")
    kinds = {
        400: "bad_request",
        413: "too_large",
        499: "client_disconnected",
        502: "upstream_unreachable",
        503: "profile_down",
        504: "upstream_timeout",
    }
    if isinstance(status, int) and status in kinds:
        return kinds[status]
    return "upstream_stream_error" if status == 200 else "other"
