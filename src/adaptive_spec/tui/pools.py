"""A server as the profile table shows it (health, slots, requests in flight, acceptance), and the servers of a
profile's pool, one line each under the profile: a pure fold of the feed's snapshot, request and profile events."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from adaptive_spec.telemetry.events import ProfileDown, ProfileUp


@dataclass(slots=True, kw_only=True)
class ServerView:
    """What a profile and each server of its pool show alike: health, slots, the requests in flight on it, and the
    output and accepted-draft tokens of the requests it finished since the view started."""

    base_url: str = ""
    up: bool = True
    reason: str | None = None
    slots: int | None = None
    in_flight: set[str] = field(default_factory=set)
    requests: int = 0
    predicted_n: int = 0
    draft_n_accepted: int = 0

    @property
    def acceptance(self) -> float | None:
        """Share of output tokens that came from accepted drafts, since the view started."""
        return self.draft_n_accepted / self.predicted_n if self.predicted_n else None

    def read_info(self, item: Mapping[str, Any]) -> None:
        """Its address, health and slots, as the snapshot (and /adaptive/profiles) lists them."""
        self.base_url = str(item.get("base_url") or self.base_url)
        self.up = bool(item.get("up", True))
        self.reason = item.get("reason") if isinstance(item.get("reason"), str) else None
        self.slots = item["slots"] if isinstance(item.get("slots"), int) else self.slots

    def count(self, predicted: int, accepted: int) -> None:
        """One finished request's output and accepted-draft tokens."""
        self.requests += 1
        self.predicted_n += predicted
        self.draft_n_accepted += accepted


@dataclass(slots=True)
class ReplicaView(ServerView):
    index: int


def from_snapshot(replicas: dict[int, ReplicaView], listed: Any) -> None:
    """The snapshot's (and /adaptive/profiles') `replicas` of one profile."""
    if not isinstance(listed, list):
        return
    for item in listed:
        if not isinstance(item, Mapping) or not isinstance(item.get("replica"), int):
            continue
        replica(replicas, item["replica"]).read_info(item)


def index_of(value: Any) -> int:
    """A replica number as the feed gives it (a record's `replica`): 0 for none or a bad one."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def replica(replicas: dict[int, ReplicaView], index: int) -> ReplicaView:
    index = index_of(index)
    return replicas.setdefault(index, ReplicaView(index))


def finished(replicas: dict[int, ReplicaView], index: int, request_id: str, predicted: int, accepted: int) -> None:
    for view in replicas.values():
        view.in_flight.discard(request_id)
    replica(replicas, index).count(predicted, accepted)


def health(replicas: dict[int, ReplicaView], event: ProfileUp | ProfileDown) -> bool:
    """Marks the replica; returns whether the profile as a whole is up (one of its replicas is)."""
    view = replica(replicas, event.replica)
    view.base_url = event.base_url or view.base_url
    if isinstance(event, ProfileUp):
        view.up, view.reason = True, None
        return True
    view.up, view.reason = False, event.reason
    return not event.profile_down or any(r.up for r in replicas.values() if r.index != view.index)
