"""The aiohttp application: the factory that wires the shared services together, and the cleanup contexts of its
background work (the upstream client session, the sessions worker, the policy refresher, the servers' health poll
and watch)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

from adaptive_spec.access.rules import AccessPolicy
from adaptive_spec.kv.effects import KvEffects
from adaptive_spec.kv.heads.store import HeadStore
from adaptive_spec.kv.heads.values import HeadsConfig
from adaptive_spec.kv.movers import SlotMover
from adaptive_spec.kv.remote_prefill.shell import REMOTE_PREFILL, RemotePrefill
from adaptive_spec.llama import template_opening
from adaptive_spec.llama.health import SlotUse, health_poll, replica_watch
from adaptive_spec.llama.probe import ProbeRequest, other_model
from adaptive_spec.llama.profiles import ProfileInfo
from adaptive_spec.llama.upstreams import Upstream, UpstreamTable
from adaptive_spec.proxy.control import add_control_views
from adaptive_spec.proxy.sharing import share, shared_heads
from adaptive_spec.proxy.views import add_views
from adaptive_spec.requests.apis import Api
from adaptive_spec.requests.app_keys import (
    BUS,
    CLIENT,
    FRESH_CLIENT,
    HISTORY,
    KV,
    LIFECYCLE,
    METRICS,
    MOVER,
    PROFILES,
    RESTART,
    ROUTER,
    SESSIONS,
    SETTINGS,
    SHARED,
    TRACE,
    UPSTREAMS,
    ProxySettings,
)
from adaptive_spec.requests.forwarding.stranded import STRANDED, StrandedRequests
from adaptive_spec.requests.gate import install_security
from adaptive_spec.requests.gemini.views import add_gemini_views
from adaptive_spec.requests.handler import proxy_view
from adaptive_spec.requests.heads import HEADS, add_heads_views, displaced, watch_servers
from adaptive_spec.requests.lifecycle import RequestLifecycle
from adaptive_spec.requests.measured_speeds import KeptSpeeds, keep_speeds
from adaptive_spec.routing.contract import FixedPolicy, PolicySource
from adaptive_spec.routing.draft_length import capped_profiles
from adaptive_spec.routing.prompt import prefix
from adaptive_spec.routing.router import Router
from adaptive_spec.sessions.service import SessionService, run_worker
from adaptive_spec.shared_state.shell import SharedState
from adaptive_spec.streams.timings import find_timings
from adaptive_spec.telemetry.bus import EventBus
from adaptive_spec.telemetry.events import RequestFailed, RequestFinished
from adaptive_spec.telemetry.history import RequestHistory
from adaptive_spec.telemetry.metrics import ProxyMetrics
from adaptive_spec.telemetry.records import own_record
from adaptive_spec.telemetry.trace import TraceWriter

__all__ = ["KvSetup", "ProxySettings", "build_app"]
log = logging.getLogger(__name__)
_POLICY_REFRESH_S = 2.0
_CleanupCtx = Callable[[web.Application], AsyncIterator[None]]
_SLOT_SWEEP_S = 10.0  # left-over slot files go once five minutes old (kv/effects.py): no hurry


@dataclass(frozen=True, slots=True)
class KvSetup:
    """How the proxy moves KV caches: the shared slot directory, a mover between hosts, remote prefill."""

    slot_dir: Path | None = None
    mover: SlotMover | None = None  # None: the shared slot directory's, when there is one
    remote: RemotePrefill | None = None
    link_bytes_per_s: float | None = None  # the start-up probe of the relays' slowest link
    heads: HeadsConfig | None = None  # warm starts: the head store (kv/heads/), with a slot directory only
    say: Callable[[str], None] | None = None  # where the store tells the user what a warm start restored


def _add_heads(app: web.Application, kv: KvSetup) -> None:
    """Warm starts (kv/heads/): the store where there is a slot directory to restore from."""
    if kv.heads is not None and kv.slot_dir is not None:
        try:
            told = shared_heads(app, kv.heads)
            store = HeadStore(
                kv.heads, kv.slot_dir, lambda: app[CLIENT], kv.say or log.info, displaced(app), told, shared=told
            )
        except (OSError, ValueError) as exc:  # an unusable directory costs the warm starts, not the proxy
            log.warning("heads: off: %s", exc)
            add_heads_views(app)
            return
        app[HEADS] = store
        app[METRICS].watch_heads(lambda: store.counts)

        async def close(_: web.Application) -> None:
            await store.close()

        app.on_shutdown.append(close)
    add_heads_views(app)


def build_app(
    upstreams: UpstreamTable,
    settings: ProxySettings,
    sessions: SessionService | None = None,
    *,
    bus: EventBus | None = None,
    trace: TraceWriter | None = None,
    profiles: list[ProfileInfo] | None = None,
    policies: PolicySource | None = None,
    servers: Mapping[tuple[str, int], str] | None = None,
    kv: KvSetup | None = None,
    restart: Callable[[str], Awaitable[None]] | None = None,
    access: AccessPolicy | None = None,
    speeds: KeptSpeeds | None = None,
    probes: Sequence[ProbeRequest] = (),
    shared: SharedState | None = None,
) -> web.Application:
    """The proxy. `upstreams` and `sessions` publish on `bus`: build them with its `publish` (the router made here
    does). `servers`: which profiles share a llama-server (routing/router.py). `speeds`: where the speed model is
    kept, and the launched servers to measure when nothing is kept there. `shared`: the state shared with other
    proxies (none: this proxy alone)."""
    # The body limit is enforced by read_body (to answer in the OpenAI error shape), not by aiohttp.
    app = web.Application(client_max_size=settings.max_body_bytes + 1)
    install_security(app, access or AccessPolicy())  # every route, later ones included
    app[UPSTREAMS], app[SETTINGS], app[SESSIONS], app[TRACE] = upstreams, settings, sessions, trace
    app[HISTORY] = RequestHistory(settings.history_size)
    app[BUS] = bus = bus or EventBus()
    app[METRICS] = ProxyMetrics(frozenset(upstreams.names()))
    app[PROFILES] = profiles or []
    kv = kv or KvSetup()
    effects = KvEffects(upstreams, lambda: app[CLIENT], bus.publish, kv.slot_dir, kv.mover, kv.remote)
    infos = {i.name: i for i in app[PROFILES] if i.replica == 0}
    app[ROUTER] = router = Router(
        upstreams,
        policies or FixedPolicy(),
        {n: i.total_slots for n, i in infos.items()},
        {n: i.spec_types for n, i in infos.items()},
        effects,
        replica_slots={(i.name, i.replica): i.total_slots for i in app[PROFILES]},
        servers=servers,
        draft_caps=capped_profiles(infos.values()),
    )
    router.speeds.link.observe_link(kv.link_bytes_per_s)
    app[KV] = app[MOVER] = effects
    if kv.remote is not None:
        app[REMOTE_PREFILL] = kv.remote
    app[RESTART] = restart
    app[SHARED] = shared
    _add_heads(app, kv)
    share(app)
    app[LIFECYCLE] = RequestLifecycle(bus, app[HISTORY], router, sessions, trace, settings.progress_interval_s, shared)
    app[STRANDED] = StrandedRequests()  # what the health poll ends when a server stops answering
    bus.listen(app[METRICS].on_event)
    _own_requests(app, probes)
    if sessions is not None:
        app[METRICS].watch_session_updates(sessions.update_counts)
    for name in upstreams.names():
        app[METRICS].profile_up.labels(name).set(0 if upstreams.down_reason(name) else 1)
        for u in upstreams.replicas(name):
            down = upstreams.replica_down_reason(name, u.replica)
            app[METRICS].replica_up.labels(name, str(u.replica)).set(0 if down else 1)
    app.cleanup_ctx.append(_trace_file)  # first in, last out: closed after everything that writes to it
    app.cleanup_ctx.append(_client_session)
    app.cleanup_ctx.append(_template_opening)
    app.cleanup_ctx.append(_session_worker)
    app.cleanup_ctx.append(_policy_refresher)
    app.cleanup_ctx.append(_slot_sweep)
    app.cleanup_ctx.append(_replica_watch)
    app.cleanup_ctx.append(_health_poll)
    app.cleanup_ctx.append(_shared_state)
    if speeds is not None:
        keep_speeds(app, speeds, kv.say or log.info)  # before the warm starts: they follow its measurements
    watch_servers(app)  # warm starts at start and after a restart: once the client above exists
    app.on_shutdown.append(_close_feeds)
    app.on_shutdown.append(_drain)
    add_views(app, proxy_view)
    add_control_views(app)
    add_gemini_views(app, proxy_view)
    app.router.add_route("*", "/{tail:.*}", proxy_view)
    return app


async def _shared_state(app: web.Application) -> AsyncIterator[None]:
    """The shared state's lease renewal, for the proxy's life; at shutdown its bookings go and its connection closes."""
    shared = app[SHARED]
    if shared is None:
        yield
        return
    task = asyncio.get_running_loop().create_task(shared.renewing())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await shared.close()


def _own_requests(app: web.Application, probes: Sequence[ProbeRequest]) -> None:
    """The requests the proxy sent at start to learn about its servers, recorded as its own: the history and the
    metrics count them as llama-server does."""
    for sent in probes:
        timings = find_timings(sent.answer) if sent.answer is not None else None
        record = own_record(
            uuid.uuid4().hex[:16],
            own="speculation types probe",
            path=sent.path,
            api=Api.COMPLETION,
            profile=sent.profile,
            replica=sent.replica,
            timings=timings,
            error=sent.error,
            started_at_unix=sent.started_unix,
            total_ms=sent.total_ms,
        )
        app[HISTORY].add(record)
        as_json = record.to_json()
        app[METRICS].on_event(
            RequestFinished(record=as_json) if record.outcome == "finished" else RequestFailed(record=as_json)
        )


async def _close_feeds(app: web.Application) -> None:
    app[BUS].close_all()  # event feeds end before the server stops waiting for its handlers


async def _drain(app: web.Application) -> None:
    if app[LIFECYCLE].stopping:  # `serve` ended its requests itself before stopping the app (proxy/run.py)
        return
    ended = await app[LIFECYCLE].drain(app[SETTINGS].shutdown_grace_s)
    if ended:
        log.warning(
            "ended %d requests still running after the %.0f s shutdown grace", ended, app[SETTINGS].shutdown_grace_s
        )


async def _client_session(app: web.Application) -> AsyncIterator[None]:
    # No connection limit (each request holds one for its whole stream) and no decompression (bytes pass as sent).
    # Idle connections are dropped after 2 s, before llama-server's own keep-alive timeout (5 s) closes them under us.
    connector = aiohttp.TCPConnector(limit=0, force_close=False, keepalive_timeout=2.0)
    # A request the pool sent on a connection the server had closed is sent again on a new one: under load a server
    # can close several idle connections at once, and another pooled one may be just as dead.
    fresh = aiohttp.TCPConnector(limit=0, force_close=True)
    async with (
        aiohttp.ClientSession(connector=connector, auto_decompress=False) as session,
        aiohttp.ClientSession(connector=fresh, auto_decompress=False) as fresh_session,
    ):
        app[CLIENT], app[FRESH_CLIENT] = session, fresh_session
        yield


async def _template_opening(app: web.Application) -> AsyncIterator[None]:
    """The default profile's chat template asked, in the background, what it writes ahead of a prompt with no system
    message, for the router's estimates (`llama/template_opening.py`)."""
    upstreams, router = app[UPSTREAMS], app[ROUTER]
    upstream = upstreams.get(upstreams.default)

    async def ask(base_url: str) -> None:
        router.template_opened(await template_opening.measure(app[CLIENT], base_url, prefix.PIECE_OVERHEAD_TOKENS))

    task = asyncio.create_task(ask(upstream.base_url)) if upstream is not None else None
    yield
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _session_worker(app: web.Application) -> AsyncIterator[None]:
    service = app[SESSIONS]
    task = asyncio.create_task(run_worker(service)) if service is not None else None
    yield
    # Cancelled again until it ends: a cancel that lands as the worker takes an update must not leave the shutdown
    # waiting on it.
    while task is not None and not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
    if task is not None and not task.cancelled() and task.exception() is not None:
        log.error("the session statistics worker had failed", exc_info=task.exception())


async def _trace_file(app: web.Application) -> AsyncIterator[None]:
    """The JSONL trace is closed after the requests that write to it have ended (it was opened by `serve`)."""
    yield
    trace = app[TRACE]
    if trace is not None:
        trace.close()


def _every(interval_s: float, what: str, work: Callable[[web.Application], Awaitable[None]]) -> _CleanupCtx:
    """A cleanup context that runs `work` every `interval_s` until the app stops; a failure is logged as `what`'s
    and the next round runs as usual."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        async def loop() -> None:
            while True:
                await asyncio.sleep(interval_s)
                try:
                    await work(app)
                except Exception:
                    log.exception("%s failed", what)

        task = asyncio.create_task(loop())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    return ctx


async def _refresh_policies(app: web.Application) -> None:
    """Reload changed policy files (a bad file keeps the last good policy; the router says so)."""
    router = app[ROUTER]
    router.policies_changed(await asyncio.to_thread(router.policies.refresh))


async def _sweep_slot_files(app: web.Application) -> None:
    """Delete the proxy's own left-over slot files (`as-*`, from handoffs a fault cut short); other files in the slot
    folder, and the head store's, are never touched."""
    await asyncio.to_thread(app[KV].sweep)


_policy_refresher = _every(_POLICY_REFRESH_S, "policy refresh", _refresh_policies)
_slot_sweep = _every(_SLOT_SWEEP_S, "slot file sweep", _sweep_slot_files)


async def _health_poll(app: web.Application) -> AsyncIterator[None]:
    """Every server's /health, every few seconds (llama/health.py): a dead or hung one is marked down, and
    the requests waiting on it are ended (requests/forwarding/stranded.py)."""
    load = _server_load(app[ROUTER], app[UPSTREAMS])
    async with health_poll(app[UPSTREAMS], app[FRESH_CLIENT], load, app[STRANDED].end):
        yield


def _server_load(router: Router, table: UpstreamTable) -> SlotUse:
    """A server URL's requests in flight and slots as the router counts them, over every profile on it."""

    def load(url: str) -> tuple[int, int]:
        per_server: dict[tuple[str, int], tuple[int, int]] = {}  # profiles the router knows share it count once
        for u in table.all():
            if u.base_url == url:
                state = router.replica_states(u.name)[u.replica]
                per_server[router.home(u.name, u.replica)] = (state.in_flight, state.slots)
        return sum(n for n, _ in per_server.values()), max((s for _, s in per_server.values()), default=1)

    return load


async def _replica_watch(app: web.Application) -> AsyncIterator[None]:
    """Ask each server the proxy marked down itself (a health check or a request found it so; nobody else supervises
    it) for its /health every second, and mark its profiles up when it answers."""
    started = {(i.name, i.replica): i for i in app[PROFILES]}  # what each replica served at start

    async def same_model(client: aiohttp.ClientSession, upstream: Upstream) -> str | None:
        info = started.get((upstream.name, upstream.replica))
        return await other_model(client, upstream, info) if info is not None else None

    async with replica_watch(app[UPSTREAMS], app[FRESH_CLIENT], same_model):
        yield
