"""What the head store asks a llama-server (not its slot actions): the key its KV is valid under (`/props`), whether
its slots are idle (`/slots`; a slot action pauses them all) and whether it is fresh, holding no session's KV yet."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp

from adaptive_spec.kv.heads.files import file_size
from adaptive_spec.kv.heads.matching import ServerKey, template_digest
from adaptive_spec.llama.upstreams import Upstream

TIMEOUT = aiohttp.ClientTimeout(total=60)  # a slot action: a large head's save or restore reads or writes GBs
ASK_TIMEOUT = aiohttp.ClientTimeout(total=3)  # /props, /slots, /metrics: a server that takes longer is hung or busy
_RESTORE_FLOOR_BYTES_PER_S = 50e6  # a restore slower than this (8x below the prior) is a hung server's


def restore_timeout(size: int) -> aiohttp.ClientTimeout:
    """A restore on a request's path waits for its file's read at a slow disk's pace, not for a hung server."""
    return aiohttp.ClientTimeout(total=5.0 + size / _RESTORE_FLOOR_BYTES_PER_S)


async def server_props(client: aiohttp.ClientSession, upstream: Upstream) -> dict[str, Any]:
    async with client.get(f"{upstream.base_url}/props", timeout=ASK_TIMEOUT) as resp:
        resp.raise_for_status()
        props = await resp.json(content_type=None)
    return props if isinstance(props, dict) else {}


def model_path(props: dict[str, Any]) -> str:
    return str(props.get("model_path") or "")


def key_of(props: dict[str, Any], build: str, cache_types: tuple[str, str], model_sha256: str) -> ServerKey:
    """The key of a server's KV: its model known by content (the file's sha256: a model replaced at the same path,
    even of the same size and time, is another key), its build, context, template and cache types."""
    settings = props.get("default_generation_settings") or {}
    model = model_path(props)
    size = (file_size(Path(model)) or 0) if model else 0
    builds = f"{build}|{props.get('build_info') or ''}"
    template = template_digest(str(props.get("chat_template") or ""))
    n_ctx = int(settings.get("n_ctx") or 0)
    return ServerKey(model, size, n_ctx, template, f"sha256:{model_sha256}", builds, *cache_types)


async def idle_slots(client: aiohttp.ClientSession, upstream: Upstream, wait_s: float) -> int | None:
    """How many slots the server has once none is processing, waiting up to `wait_s`; None: still busy (a `/slots`
    that does not answer within `ASK_TIMEOUT` is busy too: it waits for the server's loop), or no `/slots` to ask."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            async with client.get(f"{upstream.base_url}/slots", timeout=ASK_TIMEOUT) as resp:
                slots = await resp.json(content_type=None) if resp.status == 200 else None
        except TimeoutError:
            slots = [{"is_processing": True}]
        if not isinstance(slots, list):
            return None
        if not any(isinstance(s, dict) and s.get("is_processing") for s in slots):
            return len(slots)
        if time.monotonic() >= deadline:
            return None
        await asyncio.sleep(0.25)


async def slot_free(client: aiohttp.ClientSession, upstream: Upstream, slot: int) -> bool:
    """Whether that slot is there and processing nothing: a slot action on it runs between the other slots' batches
    (llama-server defers one only behind its own slot's work). A `/slots` that does not answer in time: not free."""
    try:
        async with client.get(f"{upstream.base_url}/slots", timeout=ASK_TIMEOUT) as resp:
            slots = await resp.json(content_type=None) if resp.status == 200 else None
    except TimeoutError:
        return False
    if not isinstance(slots, list):
        return False
    return any(isinstance(s, dict) and s.get("id") == slot and not s.get("is_processing") for s in slots)


async def fresh(client: aiohttp.ClientSession, upstream: Upstream, own_tokens: int = 0) -> bool:
    """Whether the server has prefilled nothing yet but the proxy's own `own_tokens` (its /metrics): a server that has
    holds sessions' KV, which a warm start must not displace. Without /metrics (an attached server started without
    them) it cannot be told: no warm start there; its first turns still get heads restored when they come."""
    async with client.get(f"{upstream.base_url}/metrics", timeout=ASK_TIMEOUT) as resp:
        text = await resp.text() if resp.status == 200 else ""
    for line in text.splitlines():
        if line.startswith("llamacpp:prompt_tokens_total"):
            return float(line.split()[-1]) <= own_tokens
    return False
