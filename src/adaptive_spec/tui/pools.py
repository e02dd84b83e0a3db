"""The servers of a profile's pool as the TUI shows them: health, slots in use, requests and acceptance per replica
(a pure fold of the feed's snapshot, request and profile events; no Textual)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ReplicaView:
    index: int
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
        return self.draft_n_accepted / self.predicted_n if self.predicted_n else None


def from_snapshot(replicas: dict[int, ReplicaView], listed: Any) -> None:
    """The snapshot's (and /adaptive/profiles') `replicas` of one profile."""
    if not isinstance(listed, list):
        return
    for item in listed:
        if not isinstance(item, Mapping) or not isinstance(item.get("replica"), int):
            continue
        view = replicas.setdefault(item["replica"], ReplicaView(item["replica"]))
        view.base_url = str(item.get("base_url") or view.base_url)
        view.up = bool(item.get("up", True))
        view.reason = item.get("reason") if isinstance(item.get("reason"), str) else None
        view.slots = item["slots"] if isinstance(item.get("slots"), int) else view.slots


def index_of(payload: Mapping[str, Any]) -> int:
    value = payload.get("replica")
    return value if isinstance(value, int) and value >= 0 else 0


def started(replicas: dict[int, ReplicaView], payload: Mapping[str, Any], request_id: str) -> None:
    replicas.setdefault(index_of(payload), ReplicaView(index_of(payload))).in_flight.add(request_id)


def finished(
    replicas: dict[int, ReplicaView], record: Mapping[str, Any], request_id: str, predicted: int, accepted: int
) -> None:
    index = index_of(record)
    for view in replicas.values():
        view.in_flight.discard(request_id)
    view = replicas.setdefault(index, ReplicaView(index))
    view.requests += 1
    view.predicted_n += predicted
    view.draft_n_accepted += accepted


def health(replicas: dict[int, ReplicaView], payload: Mapping[str, Any], up: bool) -> bool:
    """Marks the replica; returns whether the profile as a whole is up (one of its replicas is)."""
    index = index_of(payload)
    view = replicas.setdefault(index, ReplicaView(index))
    view.up = up
    view.reason = None if up else str(payload.get("reason"))
    view.base_url = str(payload.get("base_url") or view.base_url)
    if up:
        return True
    return payload.get("profile_down") is False or any(r.up for r in replicas.values() if r.index != index)
