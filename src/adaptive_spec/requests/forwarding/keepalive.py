"""Keep-alive bytes for a streamed request while llama-server prefills its prompt.

During a long prefill (minutes for a 15k-token agent head on a CPU) llama-server sends nothing: b11434 not even
its headers, b11549 its 200 headers at once and then no byte until the first token. Agents with a stream idle timeout
give up (Qwen Code: 240 s). After `interval_s` with no stream bytes from upstream (headers or not) the proxy sends the
200 headers itself if they are not out yet, and a keep-alive every `interval_s` until the first bytes come: on
/v1/chat/completions a chunk with no choices (what SDK-based agents count as activity), Anthropic's own `ping` event
on /v1/messages, an SSE comment elsewhere (which timer each one resets, per agent: examples/README.md). Before the
first one a quick answer (a context overflow's 400) still reaches the client as it is. Once they are sent, an
upstream error becomes the stream's final error event in the API's own shape. Keep-alives are not an answer: a pool
still fails the request over to another replica, and the upstream read timeout is not reset by them.

SSE comments are no answer either: llama-server b11549 sends one (`:`, a blank line) after each 30 s without a result
(its `--sse-ping-interval`), which no SDK yields, so an agent that times the chunks it is given (Qwen Code's stream
guard) would hear nothing from the first one on. Comments before the stream's first event are dropped and the
keep-alives go on; after it, the server's stream passes as it comes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Mapping
from typing import Any, TypeVar

import aiohttp
import orjson
from aiohttp import web

from adaptive_spec.requests.apis import Api
from adaptive_spec.requests.error_responses import sse_error_event

T = TypeVar("T")
ANTHROPIC_PING = b'event: ping\ndata: {"type": "ping"}\n\n'
SSE_COMMENT = b": keep-alive\n\n"


# A chunk with no choices, as the usage chunk of `stream_options.include_usage` is: SDK-based agents time a stream's
# silence by the chunks their SDK yields (Qwen Code's stream guard), and an SSE comment yields none.
CHAT_EMPTY_CHUNK = b'data: {"id":"keep-alive","object":"chat.completion.chunk","created":0,"model":"","choices":[]}\n\n'


def past_comments(buffer: bytes) -> tuple[bytes, bool]:
    """`buffer` less the SSE comment lines and blank lines it opens with, and whether what is left begins an event
    (False: nothing but comments so far, or a comment line not yet whole, which is kept)."""
    rest = buffer
    while rest:
        if rest[:1] in (b"\n", b"\r"):
            rest = rest[1:]
        elif rest[:1] != b":":
            return rest, True
        elif (end := rest.find(b"\n")) < 0:
            return rest, False
        else:
            rest = rest[end + 1 :]
    return rest, False


async def _first_event(content: aiohttp.StreamReader) -> bytes:
    """A stream's bytes from its first event on, the comments before it dropped; b"": it ended before any."""
    buffer = b""
    while piece := await content.readany():
        buffer, begun = past_comments(buffer + piece)
        if begun:
            return buffer
    return b""


def ping_bytes(api: Api) -> bytes:
    if api is Api.MESSAGES:
        return ANTHROPIC_PING
    return CHAT_EMPTY_CHUNK if api is Api.CHAT else SSE_COMMENT


class PrefillKeepAlive:
    """One streamed request's keep-alives, across every attempt at it (a failover keeps the same response)."""

    def __init__(self, request: web.Request, api: Api, interval_s: float, headers: Mapping[str, str]) -> None:
        self._request, self._api, self._interval_s = request, api, interval_s
        self._headers = dict(headers)
        self.response: web.StreamResponse | None = None  # prepared at the first keep-alive
        self.sent = 0  # keep-alives written
        self.real_bytes = False  # whether anything but keep-alives went out on the response

    @property
    def api(self) -> Api:
        return self._api

    @property
    def committed(self) -> bool:
        """Whether the 200 headers went out: from now on the answer is this stream."""
        return self.response is not None

    def owns(self, resp: web.StreamResponse) -> bool:
        """`resp` is this keep-alive's response and carries keep-alives alone (a failover may still answer)."""
        return self.response is resp and not self.real_bytes

    async def during(self, work: Awaitable[T]) -> T:
        """`work`'s result, awaited in the caller's own task (the upstream request stays where it was made), with a
        keep-alive written every interval beside it until it is done. A quick answer meets only a timer: no task is
        made and the request's timing is as without keep-alives."""
        pinger: list[asyncio.Task[None]] = []
        timer = asyncio.get_running_loop().call_later(
            self._interval_s, lambda: pinger.append(asyncio.ensure_future(self._pings()))
        )
        try:
            return await work
        finally:
            timer.cancel()
            for task in pinger:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _pings(self) -> None:
        try:
            while True:
                await self._ping()
                await asyncio.sleep(self._interval_s)
        except ConnectionResetError:  # the client went away: aiohttp cancels the request's handler
            return

    async def _ping(self) -> None:
        if self.response is None:
            resp = web.StreamResponse(status=200)
            resp.content_type = "text/event-stream"
            resp.headers["Cache-Control"] = "no-cache"
            resp.headers.update(self._headers)
            await resp.prepare(self._request)
            self.response = resp
        await self.response.write(ping_bytes(self._api))
        self.sent += 1

    async def first_event(self, content: aiohttp.StreamReader) -> bytes:
        """The upstream stream's bytes from its first event on (the SSE comments before it dropped), read with the
        keep-alives going on beside them; b"": the stream ended before any event."""
        return await self.during(_first_event(content))

    def take(self) -> web.StreamResponse:
        """The committed response, for the upstream's stream to be relayed into (its headers are already out)."""
        assert self.response is not None
        self.real_bytes = True
        return self.response

    async def end_with_error(self, message: str, code: str) -> web.StreamResponse:
        """End the committed stream with the API's error event (the upstream failed, or answered an error)."""
        return await self._end(sse_error_event(self._api, message, code=code))

    async def end_with_event(self, error: Mapping[str, Any]) -> web.StreamResponse:
        """End the committed stream with this error object as its `error` event (an API's own error body)."""
        return await self._end(b"event: error\ndata: " + orjson.dumps(error) + b"\n\n")

    async def _end(self, event: bytes) -> web.StreamResponse:
        assert self.response is not None
        self.real_bytes = True
        await self.response.write(event)
        await self.response.write_eof()
        return self.response
