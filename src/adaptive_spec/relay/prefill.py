"""`POST /relay/prefill`: the relay's one door to its llama-server.

It prefills a prompt into a free slot (one token generated: llama-server b11434 samples one even with `n_predict: 0`,
and the slot then holds the prompt alone) and saves that slot under the name the caller chose, so the caller can
download it. The llama-server itself need not be reachable from anywhere but the relay.

Request: `{"path": "/v1/chat/completions", "body": {...}, "filename": "NAME.bin"}` (path: the chat or completions
API); answer: the server's `timings`, `n_saved`, `n_written`, `save_ms`, the slot used and the call's `elapsed_ms`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from adaptive_spec.kv.slot_files import valid_relay_name
from adaptive_spec.kv.slots import SlotError, slot_action
from adaptive_spec.llama.upstreams import Upstream
from adaptive_spec.relay.service import NAME_RULE, SETTINGS, check_model, error

log = logging.getLogger(__name__)
PREFILL_PATHS = frozenset(
    {"/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions", "/completion"}
)
_CLIENT = web.AppKey("relay_client", aiohttp.ClientSession)


class _Slots:
    """The server's slots, asked once (`/props` total_slots): one prefill per slot at a time."""

    def __init__(self) -> None:
        self.free: asyncio.Queue[int] = asyncio.Queue()
        self.known = False
        self.lock = asyncio.Lock()


_SLOTS = web.AppKey("relay_slots", _Slots)
# Fields that would change what the slot holds or how the answer comes back; `n`/`n_cmpl` would spread the prompt
# over other slots, behind the relay's back.
_DROPPED = (
    "stream",
    "stream_options",
    "n_probs",
    "logprobs",
    "top_logprobs",
    "timings_per_token",
    "n",
    "n_cmpl",
)
# A prompt's JSON: a 128k-token conversation is a few MB; the body is held in memory while it is parsed.
MAX_PREFILL_BODY_BYTES = 32 << 20


_SAVE_TIMEOUT = aiohttp.ClientTimeout(total=600.0)


class _ServerError(Exception):
    pass


async def _free_slots(slots: _Slots, client: aiohttp.ClientSession, url: str) -> asyncio.Queue[int]:
    async with slots.lock:
        if not slots.known:
            async with client.get(f"{url}/props", timeout=aiohttp.ClientTimeout(total=30)) as resp:
                props = await resp.json(content_type=None)
            for slot in range(int(props.get("total_slots") or 1)):
                slots.free.put_nowait(slot)
            slots.known = True
    return slots.free


async def _post(client: aiohttp.ClientSession, url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    async with client.post(
        url,
        data=orjson.dumps(body),
        headers={"Content-Type": "application/json"},
        timeout=aiohttp.ClientTimeout(total=timeout_s),
    ) as resp:
        text = await resp.text()
        if resp.status != 200:
            raise _ServerError(f"llama-server answered {url.rsplit('/', 1)[-1]} with HTTP {resp.status}: {text[:300]}")
    answer = orjson.loads(text)
    if not isinstance(answer, dict):
        raise _ServerError(f"unexpected answer from llama-server: {text[:200]}")
    return answer


async def prefill(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS]
    if settings.server_url is None:
        return error(404, "this relay has no llama-server behind it (kv-relay --server URL)", "no_server")
    refused = check_model(request)
    if refused is not None:
        return refused
    raw = await _read_bounded(request, MAX_PREFILL_BODY_BYTES)
    if raw is None:
        return error(413, f"a prefill request is at most {MAX_PREFILL_BODY_BYTES} bytes", "too_large")
    try:
        spec = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return error(400, f"the body is not JSON: {exc}", "bad_json")
    if not isinstance(spec, dict):
        return error(400, "the body is a JSON object: path, body, filename", "bad_prefill")
    path, body, filename = spec.get("path"), spec.get("body"), spec.get("filename")
    if path not in PREFILL_PATHS or not isinstance(body, dict):
        return error(400, f"path must be one of {sorted(PREFILL_PATHS)} and body an object", "bad_prefill")
    if not isinstance(filename, str) or not valid_relay_name(filename):
        return error(400, f"filename: {NAME_RULE}", "bad_name")
    client, url = request.app[_CLIENT], settings.server_url
    t0 = time.perf_counter()
    try:
        queue = await _free_slots(request.app[_SLOTS], client, url)
        slot = await queue.get()
        try:
            sent = {k: v for k, v in body.items() if k not in _DROPPED}
            sent |= {"n_predict": 1, "stream": False, "id_slot": slot, "cache_prompt": True}
            answer = await _post(client, url + path, sent, settings.prefill_timeout_s)
            saved = await slot_action(client, Upstream("llama-server", url), slot, "save", filename, _SAVE_TIMEOUT)
        finally:
            queue.put_nowait(slot)
    except (aiohttp.ClientError, TimeoutError, ValueError, _ServerError, SlotError) as exc:
        log.warning("kv-relay: prefill on %s failed: %s", url, exc)
        return error(502, f"prefill on the relay's llama-server failed: {exc or type(exc).__name__}", "server")
    problem = await asyncio.to_thread(_saved_problem, settings.slot_dir / filename, answer, saved)
    if problem is not None:
        return error(502, *problem)
    return web.json_response(
        {
            "slot": slot,
            "timings": answer.get("timings") or {},
            "n_saved": saved.get("n_saved"),
            "n_written": saved.get("n_written"),
            "save_ms": (saved.get("timings") or {}).get("save_ms"),
            "elapsed_ms": round((time.perf_counter() - t0) * 1000.0, 3),
        }
    )


async def _read_bounded(request: web.Request, limit: int) -> bytes | None:
    """The body, or None once it is past `limit`: read in pieces, so a liar's Content-Length costs nothing."""
    if request.content_length is not None and request.content_length > limit:
        return None
    parts, size = [], 0
    async for chunk in request.content.iter_chunked(1 << 20):
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
    return b"".join(parts)


def _saved_problem(path: Path, answer: dict[str, Any], saved: dict[str, Any]) -> tuple[str, str] | None:
    """Why the saved file is not the prompt's slot, or None. It must be where llama-server said it wrote it, and
    hold the prompt alone: more or fewer tokens mean another client of the server had the slot between the prefill
    and the save, and its conversation is not the caller's to download (the file is deleted)."""
    try:
        size = path.stat().st_size
    except OSError:
        size = -1
    if size != saved.get("n_written"):
        return (
            f"llama-server saved {saved.get('n_written')} bytes but {path.name!r} in the relay's --slot-dir has"
            f" {size}: is llama-server's --slot-save-path the relay's --slot-dir?",
            "slot_dir_mismatch",
        )
    timings = answer.get("timings") or {}
    prompt = int(timings.get("prompt_n") or 0) + int(timings.get("cache_n") or 0)
    if saved.get("n_saved") != prompt:
        path.unlink(missing_ok=True)
        return (
            f"the saved slot holds {saved.get('n_saved')} tokens, not the prompt's {prompt}: another request had"
            " the slot (give the relay a llama-server of its own)",
            "slot_changed",
        )
    return None


async def client_ctx(app: web.Application) -> AsyncIterator[None]:
    app[_CLIENT] = aiohttp.ClientSession()
    app[_SLOTS] = _Slots()
    yield
    await app[_CLIENT].close()


ROUTES = [web.post("/relay/prefill", prefill)]
