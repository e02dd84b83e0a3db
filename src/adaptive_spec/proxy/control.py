"""Control endpoints that act on profiles on the proxy's behalf, keeping the router's slot bookkeeping right:
`POST /adaptive/profiles/{name}/erase` empties every slot of a profile, on each server of its pool that is up (the
benchmark's known state for attached profiles; clients may not send llama-server's own slot actions through the
proxy)."""

from __future__ import annotations

import time

import aiohttp
import orjson
from aiohttp import web

from adaptive_spec.kv.slots import SlotError, slot_action
from adaptive_spec.llama.upstreams import Upstream
from adaptive_spec.requests.app_keys import CLIENT, ROUTER, UPSTREAMS
from adaptive_spec.requests.error_responses import error_response
from adaptive_spec.requests.heads import HEADS, tell_emptied

_ERASE_TIMEOUT_S = 30.0


def add_control_views(app: web.Application) -> None:
    app.router.add_post("/adaptive/profiles/{name}/erase", _erase_view)


async def _erase_view(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    table, router = request.app[UPSTREAMS], request.app[ROUTER]
    upstream = table.get(name)
    if upstream is None:
        known = ", ".join(table.names())
        return error_response(404, f"unknown profile {name!r}; known profiles: {known}", code="unknown_profile")
    # Its servers' requests, whichever profile they came for (profiles that are settings of one server share it):
    # llama-server would wait for a running request and then erase what it left: refuse instead.
    busy = sum(router.server_busy(name, r.replica) for r in table.replicas(name))
    if busy:
        return error_response(
            409,
            f"profile {name!r}'s server is serving {busy} request(s); erase it when idle",
            code="profile_busy",
        )
    started = time.monotonic()
    slots = 0
    pool = table.replicas(name)
    for replica in pool:  # every server of a pool that is up (one that is down is asked nothing)
        if len(pool) > 1 and table.replica_down_reason(name, replica.replica) is not None:
            router.slots_erased(name, replica.replica)
            continue
        failed = await _erase_replica(request, replica)
        if failed is not None:
            return failed
        slots += router.slot_count(name, replica.replica)
    body = {"erased": name, "slots": slots, "seconds": round(time.monotonic() - started, 3)}
    return web.Response(body=orjson.dumps(body), content_type="application/json")


async def _erase_replica(request: web.Request, upstream: Upstream) -> web.Response | None:
    """Erase each slot of one server; the error to answer, or None."""
    router, name = request.app[ROUTER], upstream.label
    timeout = aiohttp.ClientTimeout(total=_ERASE_TIMEOUT_S)
    try:
        for slot in range(router.slot_count(upstream.name, upstream.replica)):
            await slot_action(request.app[CLIENT], upstream, slot, "erase", None, timeout)
    except (aiohttp.ClientError, TimeoutError, SlotError) as exc:
        problem = str(exc) if isinstance(exc, SlotError) else repr(exc)
        return error_response(
            502, f"erasing profile {name!r} at {upstream.base_url} failed: {problem}", code="erase_failed"
        )
    finally:
        # Whatever was reached is empty now; a half-erased server holds nothing reliable.
        router.slots_erased(upstream.name, upstream.replica)
        tell_emptied(request.app, upstream, restarted=False)
        if (heads := request.app.get(HEADS)) is not None:
            heads.emptied(upstream)
    return None
