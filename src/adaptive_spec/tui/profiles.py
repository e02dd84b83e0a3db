"""A profile as the TUI shows it: what it drafts with, its health and slots, the decode rate and acceptance of the
last second, its since-start totals and the chart's one point a second (a pure fold; no Textual)."""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from adaptive_spec.telemetry.events import ProfileDown, ProfileUp
from adaptive_spec.tui import pools

WINDOW_S = 1.0  # the live decode rate and acceptance: a 1-second sliding window
CHART_SECONDS = 600  # the acceptance and speed chart keeps the last 10 minutes, one point a second


@dataclass(slots=True)
class ChartPoint:
    at_unix: float
    tokens_per_s: float
    acceptance: float | None  # share of this second's output tokens that came from accepted drafts


@dataclass(slots=True)
class ProfileView(pools.ServerView):
    name: str
    model: str | None = None
    spec_types: tuple[str, ...] = ()
    n_ctx: int | None = None
    default: bool = False
    window: deque[tuple[float, int, int]] = field(default_factory=deque)  # (at, output tokens, accepted) deltas
    draft_n: int = 0
    predicted_ms: float = 0.0
    chart: deque[ChartPoint] = field(default_factory=lambda: deque(maxlen=CHART_SECONDS))
    _bucket: list[int] = field(default_factory=lambda: [0, 0])  # this second's output and accepted tokens
    replicas: dict[int, pools.ReplicaView] = field(default_factory=dict)  # a pool's servers (2 or more)

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

    def read_profile(self, p: Mapping[str, Any]) -> None:
        """The profile as the snapshot (and /adaptive/profiles) lists it, with the servers of its pool."""
        self.read_info(p)
        self.model = p.get("model") or self.model
        types = p.get("spec_types")
        if isinstance(types, list | tuple):
            self.spec_types = tuple(str(t) for t in types)
        elif isinstance(types, str):
            self.spec_types = tuple(types.split(","))
        self.n_ctx = p.get("n_ctx") if isinstance(p.get("n_ctx"), int) else self.n_ctx
        self.default = bool(p.get("default", self.default))
        pools.from_snapshot(self.replicas, p.get("replicas"))

    def health(self, event: ProfileUp | ProfileDown) -> str:
        """One of its servers came up or went down; returns who to name in the log (the server, in a pool)."""
        self.up = pools.health(self.replicas, event)
        self.reason = None if self.up or isinstance(event, ProfileUp) else event.reason
        if len(self.replicas) <= 1:
            self.base_url = event.base_url or self.base_url
            return self.name
        return f"{self.name}#{pools.index_of(event.replica)}"
