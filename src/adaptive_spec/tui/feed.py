"""Where the TUI's events come from: a live proxy over HTTP (its event feed, request history and control endpoints), or
a recorded file replayed on its own clock.

Nothing here imports the proxy: the TUI is one more HTTP client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from adaptive_spec.streams.sse import SSEParser

RETRY_S = 2.0


@dataclass(frozen=True, slots=True)
class FeedItem:
    """`kind` is an event type of the feed ("snapshot", "RequestStarted", …) or one of the connection states
    "connected", "disconnected" (payload: {"error": …}) and "history" (payload: {"requests": [...]})."""

    kind: str
    payload: Mapping[str, Any]


class ControlError(Exception):
    """A control request (pin, restart) the proxy refused or could not be sent; the message says why."""


class ProxyClient:
    """The proxy's HTTP endpoints, with the API key when one is set."""

    def __init__(self, base_url: str, api_key: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        for suffix in ("/v1", "/adaptive"):
            if self.base_url.endswith(suffix):
                self.base_url = self.base_url[: -len(suffix)]
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self.headers)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def get_json(self, path: str) -> Any:
        timeout = aiohttp.ClientTimeout(total=10)
        async with self.session().get(self.base_url + path, timeout=timeout) as resp:
            body = await resp.read()
            if resp.status != 200:
                raise ControlError(_error_text(resp.status, body))
            return orjson.loads(body)

    async def post_json(self, path: str, payload: Mapping[str, Any]) -> Any:
        timeout = aiohttp.ClientTimeout(total=120)  # a restart waits for the model to load
        try:
            async with self.session().post(self.base_url + path, json=payload, timeout=timeout) as resp:
                body = await resp.read()
                if resp.status != 200:
                    raise ControlError(_error_text(resp.status, body))
                return orjson.loads(body) if body else {}
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ControlError(f"could not reach the proxy: {exc or type(exc).__name__}") from exc

    async def pin(self, session_id: str, profile: str | None) -> Any:
        from urllib.parse import quote

        return await self.post_json(f"/adaptive/sessions/{quote(session_id, safe='')}/pin", {"profile": profile})

    async def restart(self, profile: str) -> Any:
        from urllib.parse import quote

        return await self.post_json(f"/adaptive/profiles/{quote(profile, safe='')}/restart", {})

    async def events(self) -> AsyncIterator[FeedItem]:
        """Follows the feed for ever: (re)connects, yields "connected", the snapshot, the request history, then
        every event; on a break yields "disconnected" and tries again every RETRY_S seconds."""
        while True:
            try:
                async for item in self._follow():
                    yield item
                yield FeedItem("disconnected", {"error": "the proxy closed the feed"})
            except (aiohttp.ClientError, TimeoutError, ControlError, ValueError) as exc:
                yield FeedItem("disconnected", {"error": _describe(exc)})
            await asyncio.sleep(RETRY_S)

    async def _follow(self) -> AsyncIterator[FeedItem]:
        timeout = aiohttp.ClientTimeout(total=None, connect=5, sock_read=60)  # the feed sends a keep-alive every 15 s
        async with self.session().get(self.base_url + "/adaptive/events", timeout=timeout) as resp:
            if resp.status != 200:
                raise ControlError(_error_text(resp.status, await resp.read()))
            yield FeedItem("connected", {"url": self.base_url})
            parser = SSEParser()
            first = True
            async for chunk in resp.content.iter_any():
                for event in parser.feed(chunk):
                    payload = orjson.loads(event.data) if event.data else {}
                    yield FeedItem(event.event or "message", payload)
                    if first and event.event == "snapshot":
                        first = False
                        yield FeedItem("history", await self.get_json("/adaptive/requests"))
                        yield FeedItem("route", await self.get_json("/adaptive/route"))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"no adaptive-spec answers at {exc.host}:{exc.port}"
    return str(exc) or type(exc).__name__


def _error_text(status: int, body: bytes) -> str:
    try:
        data = orjson.loads(body)
        error = data.get("error") if isinstance(data, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        if message:
            return f"{status}: {message}"
    except orjson.JSONDecodeError:
        pass
    return f"{status}: {body[:200].decode('utf-8', 'replace')}"


async def replay(path: Path, speed: float = 1.0) -> AsyncIterator[FeedItem]:
    """A recorded file on its own clock, `speed` times as fast (0: as fast as possible). Two formats: a recorded
    feed (`adaptive-spec tui --record`: one {"type", ...} event a line, the snapshot first) or a `serve --trace`
    file (a "profiles" line, then one line per request), whose requests become start and finish events."""
    yield FeedItem("connected", {"url": str(path), "replay": True})
    started = time.monotonic()
    first: float | None = None
    for kind, payload, at in _replay_items(path):
        if speed > 0 and at is not None:
            first = at if first is None else first
            delay = started + (at - first) / speed - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        elif speed == 0:
            await asyncio.sleep(0)  # let the screen breathe between events
        yield FeedItem(kind, payload)
    yield FeedItem("replay-ended", {})


def _replay_items(path: Path) -> list[tuple[str, Mapping[str, Any], float | None]]:
    items: list[tuple[str, Mapping[str, Any], float | None]] = []
    with path.open("rb") as fh:
        for raw in fh:
            if not raw.strip():
                continue
            line = orjson.loads(raw)
            if "type" in line:  # a recorded feed
                items.append((str(line["type"]), line, line.get("at_unix")))
            elif line.get("kind") == "profiles":
                items.append(("snapshot", {"profiles": line.get("profiles") or [], "sessions": []}, None))
            elif line.get("kind") == "request":
                items.extend(_trace_request(line))
    items.sort(key=lambda item: item[2] if item[2] is not None else float("-inf"))
    return items


def _trace_request(line: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any], float | None]]:
    start = float(line.get("started_at_unix") or 0.0)
    end = start + float(line.get("total_ms") or 0.0) / 1000
    started = {
        "request_id": line.get("request_id"),
        "api": line.get("api"),
        "project": line.get("project"),
        "profile": line.get("profile"),
        "session_id": line.get("session_id"),
        "session_source": line.get("session_source"),
        "stream": line.get("stream"),
        "route": line.get("route"),
        "reason": line.get("reason"),
        "moved_from": line.get("moved_from"),
        "at_unix": start,
    }
    record = {k: v for k, v in line.items() if k not in ("kind", "request_sha256", "request_body", "output_text")}
    kind = "RequestFinished" if line.get("outcome") == "finished" else "RequestFailed"
    return [("RequestStarted", started, start), (kind, {"record": record, "at_unix": end}, end)]
