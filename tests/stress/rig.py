"""What the stress scripts share (the fast fake llama-server is tests/support/fakes/fast_upstream.py): a streaming
client that says how each answer ended, and the process figures (resident memory, open descriptors) of another
process."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from adaptive_spec.streams.sse import SSEEvent, SSEParser


def process_figures(pid: int) -> dict[str, int]:
    """Resident memory (KiB) and open file descriptors of process `pid`, from /proc."""
    rss = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1])
    return {"rss_kib": rss, "fds": len(list(Path(f"/proc/{pid}/fd").iterdir()))}


@dataclass(frozen=True)
class StreamResult:
    """How one streamed answer ended: `ended` is "done" (the [DONE] marker), "error-event" (a final error event),
    "http-error" (an error status before any stream), "cut" (the connection closed mid-stream, no error event) or
    "timeout"."""

    status: int
    ended: str
    text: str
    request_id: str | None
    error_code: str | None
    seconds: float


def _content(event: SSEEvent) -> tuple[str, str | None]:
    """(text, error code) of one SSE event."""
    if event.data == "[DONE]":
        return "", None
    try:
        obj = json.loads(event.data)
    except ValueError:
        return "", None
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        return "", str(obj["error"].get("code"))
    pieces = [str((c.get("delta") or {}).get("content") or "") for c in obj.get("choices") or []]
    return "".join(pieces), None


async def stream_chat(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    timeout_s: float,
    on_first_chunk: asyncio.Event | None = None,
) -> StreamResult:
    """One streamed chat request, read to its end; never raises for what the server does."""
    started = time.monotonic()
    status, request_id, text, code, ended = 0, None, "", None, "cut"
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url, json={**body, "stream": True}, headers=headers) as resp:
                status, request_id = resp.status, resp.headers.get("x-adaptive-spec-request-id")
                if status != 200:
                    error = orjson.loads(await resp.read()).get("error") or {}
                    return StreamResult(status, "http-error", "", request_id, error.get("code"), _since(started))
                parser = SSEParser()
                async for chunk in resp.content.iter_any():
                    if on_first_chunk is not None:
                        on_first_chunk.set()
                    for event in parser.feed(chunk):
                        piece, error_code = _content(event)
                        text += piece
                        code = error_code or code
                        if event.data == "[DONE]":
                            ended = "done"
                ended = "error-event" if code is not None else ended
    except TimeoutError:
        ended = "timeout"
    except (aiohttp.ClientError, ConnectionError):
        ended = "error-event" if code is not None else "cut"
    return StreamResult(status, ended, text, request_id, code, _since(started))


def _since(started: float) -> float:
    return round(time.monotonic() - started, 3)


def median(values: list[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def write_figures(figures: dict[str, Any], out: Path | None) -> None:
    text = json.dumps(figures, indent=2)
    print(text)
    if out is not None:
        out.write_text(text + "\n")
