"""What the proxy application holds: its settings and the shared services, under typed aiohttp app keys."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from adaptive_spec.kv.effects import KvEffects
from adaptive_spec.llama.profiles import ProfileInfo
from adaptive_spec.llama.upstreams import UpstreamTable
from adaptive_spec.requests.carry_out import Mover
from adaptive_spec.requests.lifecycle import RequestLifecycle
from adaptive_spec.routing.router import Router
from adaptive_spec.sessions.service import SessionService
from adaptive_spec.shared_state.shell import SharedState
from adaptive_spec.telemetry.bus import EventBus
from adaptive_spec.telemetry.history import RequestHistory
from adaptive_spec.telemetry.metrics import ProxyMetrics
from adaptive_spec.telemetry.trace import TraceWriter


@dataclass(frozen=True, slots=True)
class ProxySettings:
    max_body_bytes: int = 32 * 1024 * 1024
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 600.0  # the longest silence allowed between two chunks of a response
    history_size: int = 1000
    progress_interval_s: float = 0.25  # at most one DraftProgress event per request in this interval
    feed_content: bool = False  # the live feed carries streamed text (serve --feed-content): opt-in, like the trace's
    shutdown_grace_s: float = 10.0  # on SIGTERM, how long requests in flight may run on before they are ended
    prefill_keepalive_s: float = 10.0  # a streamed request unanswered this long gets keep-alives (0: never)


HISTORY = web.AppKey("history", RequestHistory)
UPSTREAMS = web.AppKey("upstreams", UpstreamTable)
SETTINGS = web.AppKey("settings", ProxySettings)
CLIENT = web.AppKey("client", aiohttp.ClientSession)
FRESH_CLIENT = web.AppKey("fresh_client", aiohttp.ClientSession)  # never reuses a connection: for resending
BUS = web.AppKey("bus", EventBus)
METRICS = web.AppKey("metrics", ProxyMetrics)
SESSIONS: web.AppKey[SessionService | None] = web.AppKey("sessions")
TRACE: web.AppKey[TraceWriter | None] = web.AppKey("trace")
# The state shared with other proxies (`serve --shared-state`); None: this proxy alone.
SHARED: web.AppKey[SharedState | None] = web.AppKey("shared")
PROFILES: web.AppKey[list[ProfileInfo]] = web.AppKey("profiles")
ROUTER = web.AppKey("router", Router)
RESTART: web.AppKey[Callable[[str], Awaitable[None]] | None] = web.AppKey("restart")  # launched profiles only
LIFECYCLE = web.AppKey("lifecycle", RequestLifecycle)
KV = web.AppKey("kv", KvEffects)  # the router's effects: slot moves, remote prefill, the sweep of slot files
# What carries out the KV moves routes ask for (requests/carry_out.py): the same `KvEffects`, seen as a `Mover`.
MOVER: web.AppKey[Mover] = web.AppKey("mover")
# Base URL -> the speed measurement of that launched server at start (requests/measured_speeds.py), under way or done:
# its task ends with the prompt tokens it prefilled (0: none).
MEASURING: web.AppKey[dict[str, asyncio.Task[int]]] = web.AppKey("measuring")
