"""Asking a running profile what it serves: model, context, slots and speculation types (/props, /slots), and
whether its server takes speculation settings per request (/props `speculative_per_request`)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import quote

import aiohttp

from adaptive_spec.errors import LaunchError
from adaptive_spec.llama.profiles import ProfileInfo
from adaptive_spec.llama.speculation import PerRequestSupport
from adaptive_spec.llama.upstreams import Upstream


async def _get_json(session: aiohttp.ClientSession, url: str, timeout_s: float = 30.0) -> Any:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
        if resp.status != 200:
            raise LaunchError(f"GET {url} answered {resp.status}: {(await resp.text())[:200]}")
        return await resp.json(content_type=None)


def _spec_types(slots: Any) -> tuple[tuple[str, ...] | None, bool | None]:
    if not isinstance(slots, list) or not slots or not isinstance(slots[0], dict):
        return None, None
    slot = slots[0]
    speculative = slot.get("speculative")
    params = slot.get("params")
    types = params.get("speculative.types") if isinstance(params, dict) else None
    parsed = tuple(t for t in types.split(",") if t) if isinstance(types, str) and types else None
    return parsed, speculative if isinstance(speculative, bool) else None


def _query(upstream: Upstream) -> str:
    return f"?model={quote(upstream.upstream_model, safe='')}" if upstream.upstream_model else ""


async def probe(session: aiohttp.ClientSession, upstream: Upstream) -> ProfileInfo:
    query = _query(upstream)
    base = upstream.base_url
    try:
        props = await _get_json(session, f"{base}/props{query}")
        try:
            slots = await _get_json(session, f"{base}/slots{query}")
        except LaunchError:
            slots = None  # /slots can be disabled (--no-slots); the spec types are then unknown
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise LaunchError(f"profile {upstream.label!r} at {base} cannot be reached: {exc}") from exc
    except LaunchError as exc:
        raise LaunchError(f"profile {upstream.label!r}: {exc}") from exc
    if not isinstance(props, dict):
        raise LaunchError(f"profile {upstream.name!r} at {base}: /props is not a JSON object")
    settings = props.get("default_generation_settings")
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    spec_types, speculative = _spec_types(slots)
    per_request = PerRequestSupport.from_props(props)
    if per_request is not None:  # its configured types are in /props: what this profile's requests may draft with
        spec_types = upstream.speculation.drafting_types(per_request.types)
    return ProfileInfo(
        name=upstream.name,
        base_url=base,
        upstream_model=upstream.upstream_model,
        model_path=str(props.get("model_path") or ""),
        model_alias=str(props.get("model_alias") or ""),
        n_ctx=int(n_ctx) if isinstance(n_ctx, int) else 0,
        total_slots=int(props["total_slots"]) if isinstance(props.get("total_slots"), int) else 0,
        spec_types=spec_types,
        speculative=speculative,
        replica=upstream.replica,
        per_request=per_request,
        speculation=upstream.speculation,
    )


@dataclass(frozen=True, slots=True)
class ProbeRequest:
    """A request the proxy sent a server of its own accord at start (the one-token request that makes /slots say a
    server's speculation types): its answer, kept for the proxy's own record of it."""

    profile: str
    replica: int
    path: str
    answer: dict[str, Any] | None
    error: str | None
    started_unix: float
    total_ms: float


async def probe_spec_types(
    session: aiohttp.ClientSession, upstream: Upstream, info: ProfileInfo
) -> tuple[ProfileInfo, ProbeRequest | None]:
    """A server shows its speculation types in /slots only once a slot has served a request: when they are not
    known yet, send it a one-token request and ask again. The router needs them (n-gram profile or not). The request,
    when one was sent, comes back with the answer: it is the proxy's own, recorded as such."""
    if info.spec_types is not None:
        return info, None
    if info.speculative is False:
        return replace(info, spec_types=("none",)), None
    body: dict[str, Any] = {"prompt": "Hi", "n_predict": 1, "cache_prompt": False}
    if upstream.upstream_model:
        body["model"] = upstream.upstream_model
    started, started_unix = time.perf_counter(), time.time()
    answer: dict[str, Any] | None = None
    error: str | None = None
    try:
        async with session.post(
            f"{upstream.base_url}/completion", json=body, timeout=aiohttp.ClientTimeout(total=120)
        ) as resp:
            raw = await resp.read()
            error = None if resp.status == 200 else f"HTTP {resp.status}"
        parsed = json.loads(raw) if error is None else None
        answer = parsed if isinstance(parsed, dict) else None
        probed = await probe(session, upstream)
    except (aiohttp.ClientError, TimeoutError, LaunchError, ValueError) as exc:
        error, probed = error or str(exc) or type(exc).__name__, info
    sent = ProbeRequest(
        upstream.name,
        upstream.replica,
        "/completion",
        answer,
        error,
        started_unix,
        (time.perf_counter() - started) * 1e3,
    )
    return probed, sent


async def other_model(
    session: aiohttp.ClientSession, upstream: Upstream, expected: ProfileInfo, timeout_s: float = 2.0
) -> str | None:
    """Why a server that answers again at a replica's address may not take the replica's sessions: it serves
    another model than the one probed there at start (named as the start-up check names it,
    `ProfileInfo.model_identity`), or cannot say which. None: the same model."""
    if not expected.model_identity:
        return None  # nothing was known at start to compare with
    try:
        props = await _get_json(session, f"{upstream.base_url}/props{_query(upstream)}", timeout_s)
    except (aiohttp.ClientError, TimeoutError, ValueError, LaunchError) as exc:
        return f"answers /health but its /props does not say which model it serves ({exc or type(exc).__name__})"
    if not isinstance(props, dict):
        return "answers /health but its /props is not a JSON object"
    served = replace(
        expected, model_path=str(props.get("model_path") or ""), model_alias=str(props.get("model_alias") or "")
    ).model_identity
    if served == expected.model_identity:
        return None
    return f"came back serving {served!r}, not the pool's {expected.model_identity!r}"
