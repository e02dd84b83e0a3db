"""What a request is sent upstream as: the profile's server it goes to, its body (the client's bytes, or with the
per-request speculation, per-token timings, slot and router preset it needs), its path and query, and the proxy's own
headers on it."""

from __future__ import annotations

from dataclasses import replace
from typing import Any
from urllib.parse import quote, unquote_plus

import orjson
from aiohttp import web

from adaptive_spec.access.rules import KEY_PARAMETER, with_model
from adaptive_spec.common.headers import PROFILE_HEADER, REPLICA_HEADER, REQUEST_ID_HEADER, ROUTE_HEADER
from adaptive_spec.llama.speculation import merge_fields
from adaptive_spec.llama.upstreams import Upstream, UpstreamTable
from adaptive_spec.requests.apis import Api, traits
from adaptive_spec.requests.body.parse import RoutedPath, with_fields
from adaptive_spec.requests.forwarding.outcome import Outcome
from adaptive_spec.requests.forwarding.sent import Sent
from adaptive_spec.requests.lifecycle import ProxyRequest

# The llama-server path a translated body goes to, by the API it was translated to.
TRANSLATED_PATHS: dict[str, str] = {Api.CHAT: "/v1/chat/completions"}


class BodyTooLarge(Exception):
    """The client's body is larger than `serve` takes."""


async def read_body(request: web.Request, limit: int) -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge
    parts: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_any():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        parts.append(chunk)
    return b"".join(parts)


def choose_upstream(
    request: web.Request, table: UpstreamTable, name: str | None = None, replica: int | None = None
) -> Upstream | Outcome:
    """The upstream of profile `name` (default: the one the header pins, else the default), or the refusal.
    `replica`: which server of its pool (None: the first one up)."""
    name = name or request.headers.get(PROFILE_HEADER) or table.default
    if replica is None:
        up = [u for u in table.replicas(name) if table.replica_down_reason(name, u.replica) is None]
        replica = up[0].replica if up else 0
    upstream = table.get(name, replica)
    if upstream is None:
        known = ", ".join(table.names())
        message = f"unknown profile {name!r} in {PROFILE_HEADER}; known profiles: {known}"
        return Outcome(400, message, "unknown_profile", PROFILE_HEADER)
    reason = table.replica_down_reason(name, replica)
    if reason is not None:
        return Outcome(503, f"profile {name!r} at {upstream.base_url} is down: {reason}", "profile_unavailable")
    return upstream


def upstream_path(routed: RoutedPath) -> str:
    """The llama-server path a request goes to: its own, or the path of the API its body was translated to."""
    translated = traits(routed.api).translated_to
    return TRANSLATED_PATHS[translated] if translated is not None else routed.upstream_path


def upstream_target(request: web.Request, upstream: Upstream, routed: RoutedPath) -> str:
    """The path and query llama-server is sent: the request's own (a Gemini client's `?key=` left out), or for a
    translated request the path of the API its body was translated to, without the client's query."""
    if traits(routed.api).translated_to is not None:
        return upstream_path(routed)
    return routed.upstream_path + _upstream_query(request, upstream, routed.api)


def _upstream_query(request: web.Request, upstream: Upstream, api: Api) -> str:
    """Router-mode servers take the preset as `?model=` on GET endpoints such as /props and /slots: always the
    profile's own (a client's `model` would make the router load another model). A key sent as `?key=` stays here."""
    qs = request.rel_url.raw_query_string  # as sent: decoding it could turn an encoded '&' into a separator
    preset = upstream.upstream_model
    if qs and (preset is not None or KEY_PARAMETER in request.query):
        dropped = {KEY_PARAMETER, "model"} if preset is not None else {KEY_PARAMETER}
        kept = [p for p in qs.split("&") if p and unquote_plus(p.split("=", 1)[0]) not in dropped]
        qs = "&".join(kept)
    if preset is not None and request.method == "GET" and api is Api.OTHER:
        qs = "&".join([*([qs] if qs else []), "model=" + quote(preset, safe="")])
    return f"?{qs}" if qs else ""


def upstream_body(req: ProxyRequest, upstream: Upstream, watched: bool) -> Sent:
    """The bytes to send: the client's, unless a router preset must be named or per-token timings are wanted (for
    the live draft progress, only while a live view is `watched`: otherwise the answer's bytes pass on untouched)."""
    parsed = req.parsed
    if parsed is None:
        preset = upstream.upstream_model
        return Sent(with_model(req.body, preset) if preset is not None and req.body else req.body)
    body, raw = (req.rewrite.body, req.rewrite.raw) if req.rewrite is not None else (parsed.body, req.body)
    added: dict[str, Any] = {}
    speculation: dict[str, Any] | None = None
    if traits(req.routed.api).speculation:
        settings = upstream.speculation
        cap = req.decision.n_max if req.decision is not None else None
        if cap is not None:  # the router's draft length for this session (routing/draft_length.py)
            settings = replace(settings, n_max=cap)
        added, speculation = merge_fields(body, settings, by="router" if cap is not None else "profile")
    strip = watched and parsed.stream and traits(req.routed.api).progress and "timings_per_token" not in body
    if strip:
        added["timings_per_token"] = True
    if req.slot is not None and "id_slot" not in body:
        added["id_slot"] = req.slot
    if upstream.upstream_model is not None and parsed.model != upstream.upstream_model:
        return Sent(orjson.dumps({**body, **added, "model": upstream.upstream_model}), strip, speculation)
    return Sent(with_fields(raw, added) if added else raw, strip, speculation)


def extra_headers(req: ProxyRequest, chosen: Upstream) -> dict[str, str]:
    """Sent upstream and back to the client: which request this is, the profile that served it, and why."""
    headers = {REQUEST_ID_HEADER: req.request_id, PROFILE_HEADER: chosen.name}
    if req.decision is not None:
        headers[ROUTE_HEADER] = req.decision.kind
    if req.pool_size > 1:
        headers[REPLICA_HEADER] = str(chosen.replica)
    return headers
