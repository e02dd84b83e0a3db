"""Relaying one upstream answer to the client as it comes, metered chunk by chunk: a stream, a body, an error body
in the client's API's shape, or an answer translated back into Gemini's API (requests/gemini/reply.py)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

import aiohttp
import orjson
from aiohttp import web

from adaptive_spec.llama.upstreams import Upstream
from adaptive_spec.requests.apis import Api, traits
from adaptive_spec.requests.body.compat import anthropic_overflow
from adaptive_spec.requests.error_responses import as_anthropic, as_client_error, as_google, sse_error_event
from adaptive_spec.requests.gemini.reply import GeminiAnswer, google_error
from adaptive_spec.streams.meter import ResponseMeter
from adaptive_spec.streams.tap import StreamTap

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
_DROP_RESPONSE = HOP_BY_HOP | {"content-length", "server", "date"}
# Non-streamed bodies up to this size are parsed for their timings; larger ones just pass through.
_METER_BODY_LIMIT = 8 * 1024 * 1024
ERROR_BODY_LIMIT = 64 * 1024
# A failure of the relay after the headers went out: the message and the code of the stream's last error event.
Failure = tuple[str, str]


@dataclass(eq=False, slots=True)
class Answering:
    """The response that carries the server's answer to the client, once one is chosen (the keep-alives' stream or
    the relay's own): whether its headers went out decides how a request the proxy ends is told."""

    response: web.StreamResponse | None = None


@dataclass(frozen=True, slots=True)
class Relay:
    """How to relay one response: to whom it belongs, and what to do with each piece."""

    upstream: Upstream
    api: Api
    meter: ResponseMeter
    started: float
    strip: bool
    progress: Callable[[], None] | None
    answering: Answering
    reply: GeminiAnswer | None = None  # a translated request's answer, translated back as it is relayed

    def where(self) -> str:
        return f"profile {self.upstream.name!r} at {self.upstream.base_url}"


async def relay_answer(
    request: web.Request,
    upstream_resp: aiohttp.ClientResponse,
    relay: Relay,
    extra_headers: Mapping[str, str],
    committed: web.StreamResponse | None = None,
    head: bytes | None = None,
) -> tuple[web.StreamResponse, bool, Failure | None]:
    """The response relayed, whether the client hung up while it was written (a write to a closing transport
    raises ConnectionResetError before aiohttp gets to cancel the handler: a disconnect, not a fault), and how the
    relay failed after the headers went out, if it did. `committed`: a stream whose headers the keep-alives sent;
    `head`: the stream's first bytes, already read (`_first_bytes`)."""
    if committed is not None:
        try:
            return committed, False, await _relay_sse(committed, upstream_resp, relay, head)
        except ConnectionResetError:
            return committed, True, None
    resp = web.StreamResponse(status=upstream_resp.status, reason=upstream_resp.reason)
    relay.answering.response = resp
    for key, value in upstream_resp.headers.items():
        if key.lower() not in _DROP_RESPONSE:
            resp.headers.add(key, value)
    resp.headers.update(extra_headers)
    is_sse = upstream_resp.content_type == "text/event-stream"
    if relay.reply is not None:  # the translation's own type, and a length of its own
        resp.content_type = relay.reply.content_type if is_sse else "application/json"
    elif upstream_resp.content_length is not None and not is_sse:
        resp.content_length = upstream_resp.content_length
    error = await _error_body(upstream_resp, relay.api) if not is_sse else None
    try:
        if error is not None:  # read whole already: answered in one piece
            status, body = error
            resp.set_status(status)
            resp.content_length = len(body)
            await resp.prepare(request)
            await resp.write(body)
            await resp.write_eof()
            return resp, False, None
        await resp.prepare(request)
        if is_sse:
            failure = await _relay_sse(resp, upstream_resp, relay, head)
        elif relay.reply is not None:
            failure = await _relay_translated_body(request, resp, upstream_resp, relay)
        else:
            failure = await _relay_body(request, resp, upstream_resp, relay)
    except ConnectionResetError:
        return resp, True, None
    return resp, False, failure


async def _error_body(upstream_resp: aiohttp.ClientResponse, api: Api) -> tuple[int, bytes] | None:
    """A profile's error for a generating request, as the client should get it: llama-server answers 500 for some
    bodies it cannot parse (the client's mistake: 400), and /v1/messages errors in OpenAI's shape (Anthropic
    clients parse their own). None: relay the answer as it is."""
    length = upstream_resp.content_length
    if not traits(api).checked_errors or upstream_resp.status < 400 or length is None or length > ERROR_BODY_LIMIT:
        return None
    try:
        body = await upstream_resp.content.readexactly(length)
    except (aiohttp.ClientError, asyncio.IncompleteReadError, TimeoutError):
        return None
    status, body = as_client_error(upstream_resp.status, body)
    if traits(api).google:
        return status, as_google(status, body) or orjson.dumps(
            google_error(status, body[:1000].decode(errors="replace"))
        )
    if not traits(api).anthropic:
        return status, body
    overflow = anthropic_overflow(body) if api is Api.MESSAGES else None  # worded so that Claude Code compacts
    return status, orjson.dumps(overflow) if overflow is not None else (as_anthropic(status, body) or body)


async def _relay_sse(
    resp: web.StreamResponse, upstream_resp: aiohttp.ClientResponse, relay: Relay, head: bytes | None = None
) -> Failure | None:
    meter, progress, reply = relay.meter, relay.progress, relay.reply
    tap = StreamTap(meter, strip=relay.strip)
    started, clock = relay.started, time.perf_counter
    try:
        chunks = upstream_resp.content.iter_any() if head is None else _after(head, upstream_resp.content)
        async for chunk in chunks:
            out = tap.feed(chunk, (clock() - started) * 1000.0)
            if reply is not None:
                out = reply.feed(out)
            if out:
                await resp.write(out)
            if progress is not None:
                progress()
            elif tap.passes_through and reply is None:
                break
        if tap.passes_through and progress is None and reply is None:  # the rest as it comes, for the meter
            keep, write, last = relay.meter.keep, resp.write, (b"", b"")
            async for chunk in chunks:
                keep(chunk)
                last = (last[1], chunk)
                await write(chunk)
            tap.passed(last)
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        message = f"{relay.where()} closed the stream before it ended: {exc}"
        return await end_stream_with_error(resp, relay, message, "upstream_disconnected")
    except TimeoutError:
        message = f"{relay.where()} stopped sending (read timeout)"
        return await end_stream_with_error(resp, relay, message, "upstream_timeout")
    if tap.close() and meter.error is None:
        message = f"{relay.where()} ended the stream in the middle of an event"
        return await end_stream_with_error(resp, relay, message, "upstream_truncated")
    if reply is not None:
        await resp.write(reply.close())
    await resp.write_eof()
    return None


async def _after(head: bytes, content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """`head`, then the rest of the stream as it comes (b"": the stream had ended)."""
    if head:
        yield head
    async for chunk in content.iter_any():
        yield chunk


async def end_stream_with_error(resp: web.StreamResponse, relay: Relay, message: str, code: str) -> Failure:
    if relay.reply is not None:  # its translation frames the error as its stream's last element
        await resp.write(relay.reply.error(message, code))
    else:  # the partial event (if any) is cut off by a blank line first, so the error is an event of its own
        await resp.write(b"\n\n" + sse_error_event(relay.api, message, code=code))
    await resp.write_eof()
    return message, code


async def _relay_body(
    request: web.Request,
    resp: web.StreamResponse,
    upstream_resp: aiohttp.ClientResponse,
    relay: Relay,
) -> Failure | None:
    upstream, meter = relay.upstream, relay.meter
    keep = upstream_resp.content_type == "application/json"
    parts: list[bytes] = []
    size = 0
    try:
        async for chunk in upstream_resp.content.iter_any():
            await resp.write(chunk)
            if keep:
                size += len(chunk)
                keep = size <= _METER_BODY_LIMIT
                parts.append(chunk)
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, TimeoutError) as exc:
        # Headers (with a length) are out: closing the connection is how the client learns the body is short.
        if request.transport is not None:
            request.transport.close()
        return f"profile {upstream.name!r} at {upstream.base_url} broke off the response: {exc!r}", "upstream_error"
    if keep:
        meter.on_body(b"".join(parts))
    await resp.write_eof()
    return None


async def _relay_translated_body(
    request: web.Request, resp: web.StreamResponse, upstream_resp: aiohttp.ClientResponse, relay: Relay
) -> Failure | None:
    """A whole answer read, metered and written translated (one object to translate: it cannot go out in pieces)."""
    assert relay.reply is not None
    try:
        data = await upstream_resp.read()
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, TimeoutError) as exc:
        if request.transport is not None:
            request.transport.close()
        return f"{relay.where()} broke off the response: {exc!r}", "upstream_error"
    relay.meter.on_body(data)
    await resp.write(relay.reply.body(upstream_resp.status, data))
    await resp.write_eof()
    return None
