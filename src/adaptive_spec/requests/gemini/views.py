"""Gemini's routes, at the root and under `/p/<project>/`: `generateContent` and `streamGenerateContent` go through the
request handler like every generating request; the model list, one model and `countTokens` the proxy answers itself.

Every model name is served by the default profile's model: the list names that model, and asking for any model by
name (`gemini-2.5-pro`) answers with that name and the served model's limits. `countTokens` counts the prompt as
llama-server's chat template renders it (`/apply-template`) and its tokenizer splits it (`/tokenize`). Like the
proxy's own `/adaptive/*` views, these three leave no request record."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote

import aiohttp
import orjson
from aiohttp import web

from adaptive_spec.llama.profiles import ProfileInfo
from adaptive_spec.llama.upstreams import Upstream
from adaptive_spec.requests.app_keys import CLIENT, PROFILES, SETTINGS, UPSTREAMS
from adaptive_spec.requests.body.shapes import RequestProblem
from adaptive_spec.requests.error_responses import answer, error_response
from adaptive_spec.requests.forwarding.forward import upstream_headers
from adaptive_spec.requests.forwarding.outcome import Outcome
from adaptive_spec.requests.gate import hidden_headers, routed_path
from adaptive_spec.requests.gemini.request import GeminiTarget, gemini_target, to_chat
from adaptive_spec.requests.outgoing import BodyTooLarge, choose_upstream, read_body

_METHODS = ["generateContent", "streamGenerateContent", "countTokens"]
_MODEL = "{model:[^/:]+}"  # a model name has no colon: `models/<model>:<method>` is another route


def add_gemini_views(app: web.Application, proxy_view: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> None:
    """Gemini's routes, at the root and under a project prefix (the gate has checked the project's name)."""
    for prefix in ("", "/p/{project}"):
        base = prefix + "/v1beta/models"
        app.router.add_get(base, _models_view)
        app.router.add_get(f"{base}/{_MODEL}", _model_view)
        app.router.add_post(f"{base}/{_MODEL}:generateContent", proxy_view)
        app.router.add_post(f"{base}/{_MODEL}:streamGenerateContent", proxy_view)
        app.router.add_post(f"{base}/{_MODEL}:countTokens", _count_tokens_view)


def _served(app: web.Application) -> ProfileInfo | None:
    default = app[UPSTREAMS].default
    return next((i for i in app[PROFILES] if i.name == default and i.replica == 0), None)


def model_resource(name: str, served: ProfileInfo | None) -> dict[str, Any]:
    """A Gemini Model resource named `name`, with the served model's context as its input limit."""
    out: dict[str, Any] = {
        "name": f"models/{name}",
        "baseModelId": name,
        "version": "local",
        "displayName": name,
        "description": f"served by llama-server ({served.model_identity})" if served else "served by llama-server",
        "supportedGenerationMethods": _METHODS,
    }
    if served is not None and served.n_ctx > 0:
        out["inputTokenLimit"] = out["outputTokenLimit"] = served.n_ctx
    return out


async def _models_view(request: web.Request) -> web.Response:
    served = _served(request.app)
    name = served.model_identity if served is not None else "local"
    return web.json_response({"models": [model_resource(name, served)]}, dumps=_dumps)


async def _model_view(request: web.Request) -> web.Response:
    return web.json_response(model_resource(request.match_info["model"], _served(request.app)), dumps=_dumps)


def _dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


async def _count_tokens_view(request: web.Request) -> web.Response:
    """`{"totalTokens": N}`: the request's prompt, rendered and tokenized by the default profile's llama-server."""
    target = gemini_target(unquote(routed_path(request).upstream_path))
    assert target is not None  # the route matched a `models/<model>:countTokens` path
    upstream = choose_upstream(request, request.app[UPSTREAMS])
    if isinstance(upstream, Outcome):
        return answer(upstream)
    limit = request.app[SETTINGS].max_body_bytes
    try:
        raw = await read_body(request, limit)
    except BodyTooLarge:
        return error_response(413, f"request body is larger than the limit of {limit} bytes", code="request_too_large")
    counted = await _count(request, upstream, raw, target)
    if isinstance(counted, Outcome):
        return answer(counted)
    return web.json_response({"totalTokens": counted}, dumps=_dumps)


async def _count(request: web.Request, upstream: Upstream, raw: bytes, target: GeminiTarget) -> int | Outcome:
    translated = to_chat(raw, target)
    if isinstance(translated, RequestProblem):
        return Outcome(400, translated.message, translated.code, translated.param)
    preset = {"model": upstream.upstream_model} if upstream.upstream_model is not None else {}
    where = f"profile {upstream.label!r} at {upstream.base_url}"
    try:
        rendered = await _ask(request, upstream, "/apply-template", {**translated.chat, **preset})
        prompt = rendered.get("prompt")
        if not isinstance(prompt, str):
            return Outcome(502, f"{where} rendered no prompt: {str(rendered)[:200]}", "upstream_error")
        body = {"content": prompt, "add_special": True, "parse_special": True, **preset}
        tokens = (await _ask(request, upstream, "/tokenize", body)).get("tokens")
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return Outcome(
            502, f"profile {upstream.label!r} at {upstream.base_url} could not count: {exc!r}", "upstream_error"
        )
    if not isinstance(tokens, list):
        return Outcome(502, f"profile {upstream.label!r} at {upstream.base_url} returned no tokens", "upstream_error")
    return len(tokens)


async def _ask(request: web.Request, upstream: Upstream, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """One JSON call to the profile's llama-server, with the client's headers as a forwarded request has them."""
    settings = request.app[SETTINGS]
    timeout = aiohttp.ClientTimeout(
        total=None, sock_connect=settings.connect_timeout_s, sock_read=settings.read_timeout_s
    )
    headers = upstream_headers(request.headers, hidden_headers(request))
    headers["Content-Type"] = "application/json"
    async with request.app[CLIENT].post(
        upstream.base_url + path, data=orjson.dumps(body), headers=headers, timeout=timeout
    ) as resp:
        data = await resp.read()
        if resp.status >= 400:
            raise ValueError(f"{path} answered {resp.status}: {data[:300].decode(errors='replace')}")
    obj = orjson.loads(data)
    if not isinstance(obj, dict):
        raise ValueError(f"{path} answered something that is not a JSON object")
    return obj
