"""Which llama-server each launched profile runs on: all of them as per-request settings of one server when it takes
them (its /props says so), else one server per profile (a stock llama-server: the others get their own); and the
start-up line that says which design is in use."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from adaptive_spec.llama.launch import Launcher
from adaptive_spec.llama.probe import ProbeRequest, probe, probe_spec_types
from adaptive_spec.llama.profiles import ProfileInfo, ProfileSpec, one_server, shared_servers
from adaptive_spec.llama.upstreams import Upstream, UpstreamTable

ONE_SERVER = "one llama-server, speculation per request"
PER_PROFILE = "one llama-server per profile"
STOCK = f"{PER_PROFILE} (stock llama-server without per-request speculation)"
Until = Callable[[Coroutine[Any, Any, None]], Awaitable[bool]]


@dataclass(frozen=True)
class Launched:
    """The launched profiles: where each is served, on which of the launcher's servers, and the design in use."""

    upstreams: list[Upstream]
    server_of: dict[str, str]  # profile → the launcher's server it runs on
    design: str

    def profiles_on(self, server: str) -> list[str]:
        return [p for p, s in self.server_of.items() if s == server] or [server]


def design_to_launch(first: Sequence[ProfileSpec], specs: Sequence[ProfileSpec]) -> str:
    """What start-up says it is about to launch, before the probe tells whether the one server takes the others."""
    return f"planned: {ONE_SERVER if len(first) == 1 < len(specs) else PER_PROFILE}"


def first_servers(specs: Sequence[ProfileSpec], shared: bool) -> list[ProfileSpec]:
    """The servers to launch first: the one that can host every profile (when `shared` is asked and one can), else
    one per profile."""
    sharing = one_server(specs) if shared else None
    return [s for s in specs if s.name == sharing.host] if sharing is not None else own_servers(specs)


def own_servers(specs: Sequence[ProfileSpec]) -> list[ProfileSpec]:
    """The profiles that get a server of their own when they cannot share one: all but the settings that exist
    only per request (`shared_only`)."""
    return [s for s in specs if not s.shared_only]


async def settle(
    launcher: Launcher, specs: Sequence[ProfileSpec], client: aiohttp.ClientSession, until: Until
) -> Launched | None:
    """After `launcher` has started `first_servers(...)`: ask the one server whether it takes speculation per
    request; if not, start the other profiles' own servers (`until` awaits that unless a stop comes first: None)."""
    endpoints = launcher.endpoints
    sharing = one_server(specs) if len(endpoints) == 1 < len(specs) else None
    if sharing is None:
        own = [Upstream(s.name, endpoints[s.name]) for s in specs if s.name in endpoints]
        return Launched(own, {u.name: u.name for u in own}, PER_PROFILE)
    url = endpoints[sharing.host]
    info = await probe(client, Upstream(sharing.host, url))
    if info.per_request is not None:
        upstreams = [Upstream(name, url, speculation=settings) for name, settings in sharing.settings]
        return Launched(upstreams, {name: sharing.host for name, _ in sharing.settings}, ONE_SERVER)
    if not await until(launcher.add([s for s in own_servers(specs) if s.name != sharing.host])):
        return None
    endpoints = launcher.endpoints
    own = [Upstream(s.name, endpoints[s.name]) for s in specs if s.name in endpoints]
    return Launched(own, {u.name: u.name for u in own}, STOCK)


def health_hooks(launched: Launched, table: UpstreamTable) -> tuple[Callable[[str], None], Callable[[str, str], None]]:
    """The launcher's hooks: a server going down or up takes every profile on it along."""

    def up(server: str) -> None:
        for profile in launched.profiles_on(server):
            table.mark_up(profile)

    def down(server: str, reason: str) -> None:
        for profile in launched.profiles_on(server):
            table.mark_down(profile, reason)

    return up, down


def restarter(launched: Launched, launcher: Launcher) -> Callable[[str], Awaitable[None]]:
    """Restart a profile: its server (with every profile on it). KeyError for a profile not launched."""

    async def restart(profile: str) -> None:
        await launcher.restart(launched.server_of[profile])

    return restart


async def probe_profiles(
    client: aiohttp.ClientSession, upstreams: Sequence[Upstream], launched: Sequence[ProfileSpec] | None
) -> tuple[list[ProfileInfo], dict[tuple[str, int], str], list[ProbeRequest]]:
    """What each profile's server says about itself, the servers profiles share (`shared_servers`), and the
    requests the proxy sent to find out (recorded as its own)."""
    infos = [await probe(client, u) for u in upstreams]
    sent: list[ProbeRequest] = []
    if launched is not None:  # before its first request /slots does not say; the launcher knows
        known = {spec.name: spec.spec_types for spec in launched}
        infos = [replace(i, spec_types=i.spec_types or known.get(i.name)) for i in infos]
    else:  # the router must know which attached profiles draft from n-grams: ask each one that has not said
        probed = [await probe_spec_types(client, u, i) for u, i in zip(upstreams, infos, strict=True)]
        infos = [info for info, _ in probed]
        sent = [request for _, request in probed if request is not None]
    servers = shared_servers(infos)
    return [replace(i, server=servers.get((i.name, i.replica))) for i in infos], servers, sent


def describe(info: ProfileInfo) -> str:
    spec = ",".join(info.spec_types) if info.spec_types else "unknown until its first request"
    settings = f" per-request: {info.speculation.describe()}" if info.per_request is not None else ""
    return (
        f"  {info.label:<10} {info.base_url}  model={info.model_identity}  n_ctx={info.n_ctx} "
        f"slots={info.total_slots} speculative={info.speculative} spec-types={spec}{settings}"
    )


def startup_lines(infos: Sequence[ProfileInfo], servers: dict[tuple[str, int], str], design: str | None) -> list[str]:
    """`profiles:` with the design of launched ones, a line per profile, and for attached profiles a line for each
    server they share (none when each profile is its own server)."""
    lines = ["profiles:" + (f" {design}" if design is not None else "")]
    lines += [describe(info) for info in infos]
    if design is None:
        by_server: dict[str, list[str]] = {}
        for info in infos:
            server = servers.get((info.name, info.replica))
            if server is not None:
                by_server.setdefault(server, []).append(info.label)
        lines += [f"  {', '.join(names)}: {ONE_SERVER} at {server}" for server, names in by_server.items()]
    return lines
