"""The table of profiles the proxy can forward to: each profile's replicas (one llama-server each, or a pool of
them serving the same model and setup) with each replica's health as the launcher or the health watch reports it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from adaptive_spec.llama.speculation import Speculation
from adaptive_spec.telemetry.events import Event, ProfileDown, ProfileUp


@dataclass(frozen=True, slots=True)
class Upstream:
    name: str
    base_url: str
    upstream_model: str | None = None  # router-mode preset chosen by the request's `model`
    replica: int = 0  # its place in the profile's pool (0 for a profile of one server)
    # Sent in each generating request's body to a server that takes speculation settings per request.
    speculation: Speculation = field(default_factory=Speculation)
    # Its server passes `id_slot` through `/v1/messages` (patch 0006): an Anthropic request there may name its slot.
    messages_slot: bool = False

    @property
    def label(self) -> str:
        """How messages name it: the profile, and the replica when the profile has a pool."""
        return f"{self.name}#{self.replica}" if self.replica else self.name


class UpstreamTable:
    """Profiles by name, each with its replicas in the order given; owned by the proxy, marked up or down by whoever
    supervises the servers. A profile is down when all its replicas are."""

    def __init__(
        self,
        upstreams: list[Upstream],
        default: str | None = None,
        publish: Callable[[Event], None] = lambda _event: None,
    ) -> None:
        if not upstreams:
            raise ValueError("at least one profile is needed")
        self._pools: dict[str, list[Upstream]] = {}
        for u in upstreams:
            pool = self._pools.setdefault(u.name, [])
            pool.append(replace(u, replica=len(pool)))
        self.default = default or upstreams[0].name
        if self.default not in self._pools:
            raise ValueError(f"default profile {self.default!r} is not one of {self.names()}")
        # Every server takes a slot named on /v1/messages: the router may name one for an Anthropic request too.
        self.messages_slot = all(u.messages_slot for u in upstreams)
        self._down: dict[tuple[str, int], str] = {}
        self.watched: set[tuple[str, int]] = set()  # marked down by the proxy itself: the health watch asks them
        self._publish = publish

    def names(self) -> list[str]:
        return list(self._pools)

    def get(self, name: str, replica: int = 0) -> Upstream | None:
        pool = self._pools.get(name)
        return pool[replica] if pool is not None and 0 <= replica < len(pool) else None

    def replicas(self, name: str) -> list[Upstream]:
        return list(self._pools.get(name, ()))

    def all(self) -> list[Upstream]:
        return [u for pool in self._pools.values() for u in pool]

    def mark_up(self, name: str, replica: int = 0) -> None:
        self.watched.discard((name, replica))
        if self._down.pop((name, replica), None) is not None:
            upstream = self._pools[name][replica]
            self._publish(ProfileUp(profile=name, base_url=upstream.base_url, replica=replica))

    def mark_down(self, name: str, reason: str, replica: int = 0, *, watch: bool = False) -> None:
        """`watch`: nobody supervises this server (an attached one): the health watch asks it until it answers."""
        if watch:
            self.watched.add((name, replica))
        self._down[(name, replica)] = reason
        url, down = self._pools[name][replica].base_url, self.down_reason(name) is not None
        self._publish(ProfileDown(profile=name, base_url=url, reason=reason, replica=replica, profile_down=down))

    def replica_down_reason(self, name: str, replica: int = 0) -> str | None:
        return self._down.get((name, replica))

    def down_reason(self, name: str) -> str | None:
        """Why the profile is down (every replica is), or None while one of them serves."""
        pool = self._pools.get(name, [])
        reasons = [self._down.get((name, u.replica)) for u in pool]
        if not pool or any(r is None for r in reasons):
            return None
        if len(pool) == 1:
            return reasons[0]
        return "; ".join(f"#{u.replica} {r}" for u, r in zip(pool, reasons, strict=True))

    def replica_health(self, name: str) -> list[tuple[str, str | None]]:
        return [(u.base_url, self._down.get((name, u.replica))) for u in self._pools.get(name, ())]
