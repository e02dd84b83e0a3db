"""One streamed chat request, read the way the proxy reads streams: bytes as they arrive through the SSE parser
(`streams/sse.py`), timed at the client.

The bench and the benchmark scripts share it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from adaptive_spec.common.headers import PROFILE_HEADER, ROUTE_HEADER
from adaptive_spec.errors import ConfigError
from adaptive_spec.streams.sse import SSEParser


@dataclass(frozen=True, slots=True)
class StreamedReply:
    text: str
    timings: dict[str, Any] | None  # the last `timings` object of the stream, as llama-server sent it
    ttft_ms: float | None  # first / second generated piece, from just before the request was sent
    ttst_ms: float | None
    total_ms: float
    finish_reason: str | None
    served_profile: str | None  # what the proxy said in its response headers (None straight from llama-server)
    route: str | None


async def stream_chat(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    timeout: aiohttp.ClientTimeout | None = None,  # noqa: ASYNC109 - passed on to aiohttp as the request's deadline
) -> StreamedReply:
    """POST a streaming chat request and read its answer; a non-200 answer raises ConfigError."""
    started = time.perf_counter()
    ttft = ttst = None
    text: list[str] = []
    timings: dict[str, Any] | None = None
    finish: str | None = None
    pieces = 0
    parser = SSEParser()
    async with session.post(url, json=body, headers=headers or {}, timeout=timeout) as resp:
        if resp.status != 200:
            raise ConfigError(f"{url} answered {resp.status}: {(await resp.text())[:300]}")
        served, route = resp.headers.get(PROFILE_HEADER), resp.headers.get(ROUTE_HEADER)
        async for chunk in resp.content.iter_any():
            now = (time.perf_counter() - started) * 1000
            for event in parser.feed(chunk):
                if not event.data.startswith("{"):
                    continue  # [DONE], comments
                obj = orjson.loads(event.data)
                for choice in obj.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        pieces += 1
                        ttft = ttft if ttft is not None else now
                        ttst = now if ttst is None and pieces == 2 else ttst
                        text.append(piece)
                    finish = choice.get("finish_reason") or finish
                timings = obj.get("timings") or timings
    total = (time.perf_counter() - started) * 1000
    return StreamedReply("".join(text), timings, ttft, ttst, total, finish, served, route)
