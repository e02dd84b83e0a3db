"""The table of profiles the proxy can forward to, with each one's health as the launcher reports it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from adaptive_spec.core.events import Event, ProfileDown, ProfileUp


@dataclass(frozen=True, slots=True)
class Upstream:
    name: str
    base_url: str
    upstream_model: str | None = None  # router-mode preset chosen by the request's `model`


class UpstreamTable:
    """Profiles by name; owned by the proxy, marked up or down by whoever supervises the servers."""

    def __init__(
        self,
        upstreams: list[Upstream],
        default: str | None = None,
        publish: Callable[[Event], None] = lambda _event: None,
    ) -> None:
        if not upstreams:
            raise ValueError("at least one profile is needed")
        self._by_name = {u.name: u for u in upstreams}
        self.default = default or upstreams[0].name
        if self.default not in self._by_name:
            raise ValueError(f"default profile {self.default!r} is not one of {self.names()}")
        self._down: dict[str, str] = {}
        self._publish = publish

    def names(self) -> list[str]:
        return list(self._by_name)

    def get(self, name: str) -> Upstream | None:
        return self._by_name.get(name)

    def mark_up(self, name: str) -> None:
        if self._down.pop(name, None) is not None:
            upstream = self._by_name[name]
            self._publish(ProfileUp(profile=name, base_url=upstream.base_url))

    def mark_down(self, name: str, reason: str) -> None:
        self._down[name] = reason
        self._publish(ProfileDown(profile=name, base_url=self._by_name[name].base_url, reason=reason))

    def down_reason(self, name: str) -> str | None:
        return self._down.get(name)
