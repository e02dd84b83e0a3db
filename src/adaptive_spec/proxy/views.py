"""adaptive-spec's own endpoints: /adaptive/requests, /adaptive/health, /adaptive/sessions, /adaptive/events and
/metrics (its own Prometheus metrics; with an x-adaptive-spec-profile header, /metrics reaches that profile)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

import orjson
from aiohttp import web

from adaptive_spec.common.headers import PROFILE_HEADER
from adaptive_spec.errors import LaunchError
from adaptive_spec.kv.remote_prefill.shell import REMOTE_PREFILL
from adaptive_spec.requests.app_keys import (
    BUS,
    HISTORY,
    LIFECYCLE,
    METRICS,
    PROFILES,
    RESTART,
    ROUTER,
    SESSIONS,
    SHARED,
    TRACE,
    UPSTREAMS,
)
from adaptive_spec.requests.error_responses import error_response
from adaptive_spec.routing.router import Router
from adaptive_spec.telemetry import estimate_errors
from adaptive_spec.telemetry.events import SessionPinned

_HEARTBEAT_S = 15.0


def add_views(app: web.Application, proxy_view: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> None:
    app.router.add_get("/adaptive/requests", _requests_view)
    app.router.add_get("/adaptive/health", _health_view)
    app.router.add_get("/adaptive/profiles", _profiles_view)
    app.router.add_get("/adaptive/sessions", _sessions_view)
    app.router.add_get("/adaptive/events", _events_view)
    app.router.add_get("/adaptive/route", _route_view)
    app.router.add_post("/adaptive/profiles/{name}/restart", _restart_view)
    app.router.add_post("/adaptive/sessions/{session_id}/pin", _pin_view)

    async def metrics_view(request: web.Request) -> web.StreamResponse:
        if request.headers.get(PROFILE_HEADER):
            return await proxy_view(request)  # llama-server's own metrics of the pinned profile
        return web.Response(
            body=request.app[METRICS].render(),
            content_type="text/plain",
            charset="utf-8",
            headers={"Cache-Control": "no-store"},
        )

    app.router.add_get("/metrics", metrics_view)


def _json(obj: Any) -> web.Response:
    return web.Response(body=orjson.dumps(obj), content_type="application/json")


async def _requests_view(request: web.Request) -> web.Response:
    limit_text = request.query.get("limit")
    limit = int(limit_text) if limit_text and limit_text.isdigit() else None
    history = request.app[HISTORY]
    records = [r.to_json() for r in history.latest(limit)]
    # How far the routes' time estimates were from llama-server's timings, over the records shown.
    return _json(
        {
            "total": history.total,
            "own_total": history.own_total,
            "requests": records,
            "time_estimates": estimate_errors.summarize(records),
        }
    )


def _replicas(app: web.Application, name: str) -> list[dict[str, Any]]:
    """Each server of the profile's pool: health, load (the router's own count) and acceptance so far."""
    infos = {(i.name, i.replica): i for i in app[PROFILES]}
    router = app[ROUTER]
    out = []
    for r in router.replica_states(name, count_sessions=True):
        counts = router.replica_counts(name, r.index)
        drafted = counts.get("draft_n", 0)
        info = infos.get((name, r.index))
        out.append(
            {
                "replica": r.index,
                "base_url": r.base_url,
                "up": r.down_reason is None,
                "reason": r.down_reason,
                "slots": info.total_slots if info else r.slots,
                "busy_slots": r.busy_slots,
                "in_flight": r.in_flight,
                "sessions": r.sessions,
                "requests": counts.get("requests", 0),
                "predicted_n": counts.get("predicted_n", 0),
                "acceptance": round(counts.get("draft_n_accepted", 0) / drafted, 4) if drafted else None,
            }
        )
    return out


def _profiles(app: web.Application) -> list[dict[str, Any]]:
    table = app[UPSTREAMS]
    infos = {i.name: i for i in app[PROFILES] if i.replica == 0}
    out = []
    for name in table.names():
        upstream = table.get(name)
        assert upstream is not None
        info = infos.get(name)
        replicas = _replicas(app, name)
        out.append(
            {
                "name": name,
                "base_url": upstream.base_url,
                "preset": upstream.upstream_model,  # a router-mode server's preset (`URL#MODEL`), else None
                "up": table.down_reason(name) is None,
                "reason": table.down_reason(name),
                "default": name == table.default,
                "model": info.model_identity if info else None,
                "spec_types": info.spec_types if info else None,
                "n_ctx": info.n_ctx if info else None,
                # A pool's slots are all its servers' together (each replica's own are under "replicas").
                "slots": sum(r["slots"] for r in replicas) if info else None,
                "replicas": replicas,
            }
        )
    return out


async def _profiles_view(request: web.Request) -> web.Response:
    return _json({"profiles": _profiles(request.app)})


async def _health_view(request: web.Request) -> web.Response:
    health: dict[str, Any] = {
        "profiles": {p["name"]: {"up": p["up"], "reason": p["reason"]} for p in _profiles(request.app)}
    }
    trace = request.app[TRACE]
    if trace is not None:  # a trace that cannot be written (disk full) does not stop the proxy: it says so here
        health["trace"] = {"writing": trace.dropped == 0, "dropped_lines": trace.dropped_total}
    shared = request.app[SHARED]
    if shared is not None:  # several proxies: whether the state they share is reached, and what weakens meanwhile
        health["shared_state"] = shared.status()
    return _json(health)


async def _restart_view(request: web.Request) -> web.Response:
    """Restart a launched profile's llama-server: empty KV, prompt and n-gram caches (the benchmark's known state)."""
    name = request.match_info["name"]
    if request.app[UPSTREAMS].get(name) is None:
        known = ", ".join(request.app[UPSTREAMS].names())
        return error_response(404, f"unknown profile {name!r}; known profiles: {known}", code="unknown_profile")
    restart = request.app[RESTART]
    started = time.monotonic()
    try:
        if restart is None:
            raise KeyError(name)
        await restart(name)
    except KeyError:
        return error_response(
            409, f"profile {name!r} was not launched by adaptive-spec; it cannot restart it", code="not_launched"
        )
    except LaunchError as exc:
        return error_response(502, f"profile {name!r} did not come back: {exc}", code="restart_failed")
    return _json({"restarted": name, "seconds": round(time.monotonic() - started, 2)})


async def _pin_view(request: web.Request) -> web.Response:
    """Pin a session to a profile: its next turns go there and its KV cache follows (sticky, unlike the per-request
    header). `{"profile": null}` hands it back to the router."""
    session_id = request.match_info["session_id"]
    try:
        payload = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        payload = None
    profile = payload.get("profile", ...) if isinstance(payload, dict) else ...
    if profile is not None and not isinstance(profile, str):
        return error_response(
            400, 'expected a JSON body {"profile": NAME} or {"profile": null}', code="invalid_pin", param="profile"
        )
    table = request.app[UPSTREAMS]
    if profile is not None and table.get(profile) is None:
        known = ", ".join(table.names())
        return error_response(404, f"unknown profile {profile!r}; known profiles: {known}", code="unknown_profile")
    service, router = request.app[SESSIONS], request.app[ROUTER]
    known_session = (service is not None and service.known(session_id)) or router.placements.get(session_id)
    if not known_session:
        return error_response(404, f"no session {session_id!r} is known to the proxy", code="unknown_session")
    router.pin(session_id, profile)
    request.app[BUS].publish(SessionPinned(session_id=session_id, profile=profile))
    return _json({"session_id": session_id, "profile": profile, "pinned": profile is not None})


def _router_state(router: Router) -> dict[str, Any]:
    """The router's state as JSON: learned speeds, load, replicas, handoffs and what they bought, KV prices,
    placements, the policy in force and its problems, pins."""
    return {
        "speeds": [asdict(s) for s in router.speeds.describe()],
        "in_flight": dict(router.load.in_flight),
        "replicas": {n: [asdict(r) for r in router.replica_states(n, True)] for n in router.health.names()},
        "handoffs": dict(router.planner.handoffs),
        # What handoffs bought: per profile pair, the share of restored tokens the next prompt reused.
        "handoff_reuse": [
            {"from": a, "to": b, "reused_share": round(m.value(1.0), 3), "measured": round(m.n, 2)}
            for (a, b), m in router.planner.reuse.items()
        ],
        # How a KV handoff between hosts is priced (the prior until a move has measured it).
        "kv_transfer": router.speeds.link.describe(),
        "placements": [{"session_id": sid, **asdict(p)} for sid, p in router.placements.items()[-100:]],
        "policy": router.policies.describe("default", None),
        "policy_problems": [str(p) for p in router.policies.problems()],  # every file's, the last good in force
        "pins": dict(router.pins.items()),
    }


async def _route_view(request: web.Request) -> web.Response:
    """The router's state: learned speeds, where sessions' KV caches live, the policy, recent decisions; and remote
    prefill's learned terms and counts, with --pp-server."""
    body = _router_state(request.app[ROUTER])
    routed = [r for r in request.app[HISTORY].latest(None) if r.route is not None][-50:]
    body["recent_decisions"] = [
        {
            "request_id": r.request_id,
            "session_id": r.session_id,
            "profile": r.profile,
            "replica": r.replica,
            "route": r.route,
            "reason": r.reason,
            "status": r.status,
        }
        for r in routed
    ]
    remote = request.app.get(REMOTE_PREFILL)
    if remote is not None:
        body["remote_prefill"] = remote.to_json()
    return _json(body)


async def _sessions_view(request: web.Request) -> web.Response:
    service = request.app[SESSIONS]
    if service is None:
        return error_response(404, "session tracking is off", code="sessions_off")
    if request.query.get("drain") == "1":  # wait for pending updates: handy for tests and scripts
        await service.drain()
    service.expire()
    return _json(service.to_json())


def _sse(kind: str, payload: Any) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


async def _events_view(request: web.Request) -> web.StreamResponse:
    """A snapshot first (profiles, live sessions), then every event as it happens."""
    bus = request.app[BUS]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    sub = bus.subscribe()
    try:
        service = request.app[SESSIONS]
        sessions = [asdict(s) for s in service.snapshots()] if service is not None else []
        in_flight = [e.to_json() for e in request.app[LIFECYCLE].in_flight.values()]
        snapshot = {"profiles": _profiles(request.app), "sessions": sessions, "in_flight": in_flight}
        await resp.write(_sse("snapshot", snapshot))
        while True:
            try:
                async with asyncio.timeout(_HEARTBEAT_S):  # not wait_for: on Python 3.11 it can lose a cancel
                    batch = await sub.next_batch()
            except TimeoutError:
                await resp.write(b": keep-alive\n\n")
                continue
            if not batch:
                break  # the bus closed this feed: the server is stopping
            await resp.write(b"".join(_sse(type(e).__name__, e.to_json()) for e in batch))
    finally:
        bus.unsubscribe(sub)
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    return resp
