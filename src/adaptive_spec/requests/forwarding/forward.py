"""Forwarding one request to a profile and relaying its response chunk by chunk while metering it (and translating it
back into the client's API when its body was translated: requests/gemini/reply.py)."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from adaptive_spec.common.headers import PROFILE_HEADER
from adaptive_spec.llama.upstreams import Upstream
from adaptive_spec.requests.apis import Api, traits
from adaptive_spec.requests.body.compat import anthropic_overflow
from adaptive_spec.requests.error_responses import answer, as_anthropic, as_client_error, as_google, sse_error_event
from adaptive_spec.requests.forwarding.keepalive import PrefillKeepAlive
from adaptive_spec.requests.forwarding.outcome import SHUTDOWN, Outcome
from adaptive_spec.requests.forwarding.sending import send, sent_or_failed
from adaptive_spec.requests.forwarding.stranded import (
    Booking,
    StrandedRequests,
    at_work,
    first_byte,
    read_timeout,
    unread,
)
from adaptive_spec.requests.gate import hidden_headers
from adaptive_spec.requests.gemini.reply import GeminiAnswer, google_error
from adaptive_spec.requests.gemini.request import GeminiCall
from adaptive_spec.streams.meter import ResponseMeter
from adaptive_spec.streams.tap import StreamTap

_HOP_BY_HOP = frozenset(
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
# Dropped from requests: llama-server must send identity-encoded bytes, so the SSE stays parseable in flight.
_DROP_REQUEST = _HOP_BY_HOP | {"host", "content-length", "accept-encoding", PROFILE_HEADER}
_DROP_RESPONSE = _HOP_BY_HOP | {"content-length", "server", "date"}
# Non-streamed bodies up to this size are parsed for their timings; larger ones just pass through.
_METER_BODY_LIMIT = 8 * 1024 * 1024
_ERROR_BODY_LIMIT = 64 * 1024
_T = TypeVar("_T")
# A failure of the relay after the headers went out: the message and the code of the stream's last error event.
_Failure = tuple[str, str]


_KEY_HEADERS = ("authorization", "x-api-key")  # how llama-server takes its --api-key


def upstream_headers(headers: CIMultiDictProxy[str], hidden: tuple[str, ...] = ()) -> CIMultiDict[str]:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _DROP_REQUEST and k.lower() not in hidden)


@dataclass(frozen=True, slots=True)
class Forwarding:
    """One request as it is forwarded to one server, made once by its caller: the server, the path and query it is
    sent to, its body, its API, aiohttp's per-phase timeouts, when the request started (the answer's times count from
    then), the proxy's headers sent upstream and back to the client, whether the per-token timings the proxy asked for
    are taken out of the stream again (`strip`: the client did not ask for them), and for a translated request what
    its client asked for (`gemini`: its answer is translated back into Gemini's API as it is relayed)."""

    upstream: Upstream
    path_qs: str
    body: bytes
    api: Api
    timeout: aiohttp.ClientTimeout  # aiohttp's per-phase timeouts, not one deadline
    started: float
    extra_headers: Mapping[str, str]
    strip: bool = False
    gemini: GeminiCall | None = None


def _never() -> bool:
    return False


@dataclass(frozen=True, slots=True)
class Hooks:
    """What the proxy around a forward hears from it and tells it: `progress` is called after each relayed chunk;
    `shutting_down` says whether a cancellation is the shutdown's (the client is told so) rather than the client's
    own disconnect; `stranded`: where the request is booked while it waits on the server, so the health poll can end
    it if that server stops answering."""

    progress: Callable[[], None] | None = None
    shutting_down: Callable[[], bool] = _never
    stranded: StrandedRequests | None = None


async def forward(
    request: web.Request,
    sessions: tuple[aiohttp.ClientSession, aiohttp.ClientSession],
    out: Forwarding,
    meter: ResponseMeter,
    keepalive: PrefillKeepAlive | None = None,
    hooks: Hooks = Hooks(),  # a frozen value: one default shared by every call is safe
) -> tuple[web.StreamResponse, Outcome]:
    """Send `out` upstream and relay the answer, metered by `meter`; upstream faults become errors, never exceptions.
    `keepalive`: a streamed request's keep-alives while the server has not answered
    (requests/forwarding/keepalive.py)."""
    upstream, timeout = out.upstream, out.timeout
    url = upstream.base_url + out.path_qs
    headers = upstream_headers(request.headers, hidden_headers(request))
    reply = GeminiAnswer(call.model, stream=call.stream, sse=call.sse) if (call := out.gemini) is not None else None
    relay = _Relay(upstream, out.api, meter, out.started, out.strip, hooks.progress, _Answering(), reply)
    book = hooks.stranded or StrandedRequests()
    with book.book(upstream.base_url, upstream.label) as booking:
        try:
            # The answer's first byte is waited for here, not by aiohttp's read timeout: a request queued behind
            # another the server is answering (`first_byte`) is not facing a silent server.
            sent = send(sessions, request.method, url, out.body, headers, unread(timeout))
            waited = keepalive.during(sent) if keepalive is not None else sent
            keys = {k: v for k, v in headers.items() if k.lower() in _KEY_HEADERS}
            working = functools.partial(at_work, sessions[0], upstream.base_url, keys)
            answered_at = functools.partial(book.answered_at, upstream.base_url, booking)
            first = first_byte(waited, timeout.sock_read, answered_at, working)
            outcome = await sent_or_failed(first, upstream, timeout)
            if isinstance(outcome, Outcome):
                return await _failed(outcome, keepalive)
            booking.answered = True
            async with read_timeout(outcome, timeout.sock_read, working):
                return await _answered(request, outcome, relay, out.extra_headers, keepalive)
        except asyncio.CancelledError:
            # The proxy's own cancellation (the server stopped answering, the shutdown) may land at any await of
            # the block: before the answer, reading an error's body, writing the headers, relaying. Wherever it
            # does, the client is told; only the client's own disconnect goes on up.
            ended = _taken_back(hooks.shutting_down, booking)
            if ended is None:
                raise
            return await _ended(request, ended, keepalive, relay)


async def _answered(
    request: web.Request,
    upstream_resp: aiohttp.ClientResponse,
    relay: _Relay,
    extra_headers: Mapping[str, str],
    keepalive: PrefillKeepAlive | None,
) -> tuple[web.StreamResponse, Outcome]:
    """The server's answer relayed to the client, and how the request ended."""
    try:
        head = await _first_bytes(upstream_resp, keepalive)
        committed = keepalive.take() if keepalive is not None and keepalive.committed else None
        relay.answering.response = committed
        if committed is not None and keepalive is not None and not _is_stream_answer(upstream_resp):
            return await _error_after_keepalive(upstream_resp, relay.upstream, keepalive)
        resp, client_gone, failure = await _relay(request, upstream_resp, relay, extra_headers, committed, head)
    finally:
        # Closing (not releasing) drops the connection if the body was not read to the end, which tells
        # llama-server to stop generating and free the slot.
        upstream_resp.close()
    # After the headers: the relay's own failure, else the error the server's answer carried (its error event).
    if failure is not None:
        return resp, Outcome(resp.status, failure[0], failure[1], client_gone=client_gone)
    return resp, Outcome(resp.status, relay.meter.error, client_gone=client_gone)


async def _first_bytes(upstream_resp: aiohttp.ClientResponse, keepalive: PrefillKeepAlive | None) -> bytes | None:
    """A stream's first event, read with the keep-alives going on beside them: llama-server b11549 sends a stream's
    200 headers at once and nothing more until its prefill ends but a comment every 30 s, so neither is a sign that
    it has begun to answer. None: nothing read ahead (no keep-alives, or no stream); a failed read is met again by
    the relay."""
    if keepalive is None or not _is_stream_answer(upstream_resp):
        return None
    try:
        return await keepalive.first_event(upstream_resp.content)
    except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError, TimeoutError):
        return None


def _taken_back(shutting_down: Callable[[], bool], booking: Booking | None) -> Outcome | None:
    """How the request ends when the cancellation being handled is the proxy's own (its server stopped answering,
    or the shutdown ended it): then it is taken back, so the client can still be told. None: the client's."""
    task = asyncio.current_task()
    if task is None:
        return None
    if booking is not None and booking.ended is not None:
        task.uncancel()
        return booking.outcome()
    if not shutting_down():
        return None
    task.uncancel()
    return SHUTDOWN


async def _ended(
    request: web.Request, ended: Outcome, keepalive: PrefillKeepAlive | None, relay: _Relay
) -> tuple[web.StreamResponse, Outcome]:
    """The answer to a request the proxy ended, as far as it had got: before the headers of the server's answer
    went out, as a failure before the answer (a pool may still fail it over); after, its stream's error event, or for
    a body the connection closed (its length was promised)."""
    resp = relay.answering.response
    if resp is None or not resp.prepared:
        return await _failed(ended, keepalive)
    message, code = ended.error or "", ended.code or ""
    if resp.content_type == "text/event-stream" or (relay.reply is not None and relay.reply.stream):
        await _end_stream_with_error(resp, relay, message, code)
    elif request.transport is not None:
        request.transport.close()
    return resp, Outcome(resp.status, message, code)


async def _failed(outcome: Outcome, keepalive: PrefillKeepAlive | None) -> tuple[web.StreamResponse, Outcome]:
    """The answer to a request that failed before the upstream answered: the refusal as it is, or, once keep-alives
    went out, the stream's error event (a failover may still answer an unreachable one: the handler ends it)."""
    if keepalive is None or not keepalive.committed:
        return answer(outcome), outcome
    if outcome.unreachable:
        assert keepalive.response is not None
        return keepalive.response, outcome
    return await keepalive.end_with_error(outcome.error or "", outcome.code or "upstream_error"), outcome


def _is_stream_answer(upstream_resp: aiohttp.ClientResponse) -> bool:
    return upstream_resp.status < 400 and upstream_resp.content_type == "text/event-stream"


async def _error_after_keepalive(
    upstream_resp: aiohttp.ClientResponse, upstream: Upstream, keepalive: PrefillKeepAlive
) -> tuple[web.StreamResponse, Outcome]:
    """The upstream answered an error (or no stream) after the 200 headers went out: its message as the stream's
    error event, its status in the record."""
    try:
        text = (await upstream_resp.content.read(_ERROR_BODY_LIMIT)).decode(errors="replace")
    except (aiohttp.ClientError, TimeoutError) as exc:
        text = repr(exc)
    message = f"profile {upstream.name!r} at {upstream.base_url} answered {upstream_resp.status}: {text[:1000]}"
    overflow = anthropic_overflow(text.encode()) if keepalive.api is Api.MESSAGES else None
    if overflow is not None:  # the overflow as Anthropic words it, in its stream's error event; its code recorded
        code = overflow["error"]["type"]
        return await keepalive.end_with_event(overflow), Outcome(upstream_resp.status, message, code)
    resp = await keepalive.end_with_error(message, "upstream_error")
    return resp, Outcome(upstream_resp.status, message, "upstream_error")


@dataclass(eq=False, slots=True)
class _Answering:
    """The response that carries the server's answer to the client, once one is chosen (the keep-alives' stream or
    the relay's own): whether its headers went out decides how a request the proxy ends is told."""

    response: web.StreamResponse | None = None


@dataclass(frozen=True, slots=True)
class _Relay:
    """How to relay one response: to whom it belongs, and what to do with each piece."""

    upstream: Upstream
    api: Api
    meter: ResponseMeter
    started: float
    strip: bool
    progress: Callable[[], None] | None
    answering: _Answering
    reply: GeminiAnswer | None = None  # a translated request's answer, translated back as it is relayed

    def where(self) -> str:
        return f"profile {self.upstream.name!r} at {self.upstream.base_url}"


async def _relay(
    request: web.Request,
    upstream_resp: aiohttp.ClientResponse,
    relay: _Relay,
    extra_headers: Mapping[str, str],
    committed: web.StreamResponse | None = None,
    head: bytes | None = None,
) -> tuple[web.StreamResponse, bool, _Failure | None]:
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
    if not traits(api).checked_errors or upstream_resp.status < 400 or length is None or length > _ERROR_BODY_LIMIT:
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
    resp: web.StreamResponse, upstream_resp: aiohttp.ClientResponse, relay: _Relay, head: bytes | None = None
) -> _Failure | None:
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
        return await _end_stream_with_error(resp, relay, message, "upstream_disconnected")
    except TimeoutError:
        message = f"{relay.where()} stopped sending (read timeout)"
        return await _end_stream_with_error(resp, relay, message, "upstream_timeout")
    if tap.close() and meter.error is None:
        message = f"{relay.where()} ended the stream in the middle of an event"
        return await _end_stream_with_error(resp, relay, message, "upstream_truncated")
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


async def _end_stream_with_error(resp: web.StreamResponse, relay: _Relay, message: str, code: str) -> _Failure:
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
    relay: _Relay,
) -> _Failure | None:
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
    request: web.Request, resp: web.StreamResponse, upstream_resp: aiohttp.ClientResponse, relay: _Relay
) -> _Failure | None:
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
