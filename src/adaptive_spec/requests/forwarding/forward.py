"""Forwarding one request to a profile: sent, its answer waited for (keep-alives, a server that stops answering) and
handed to the relay (requests/forwarding/relay.py), and how it ended, however it failed, as an `Outcome`."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from adaptive_spec.common.headers import PROFILE_HEADER
from adaptive_spec.llama.upstreams import Upstream
from adaptive_spec.requests.apis import Api
from adaptive_spec.requests.body.compat import anthropic_overflow
from adaptive_spec.requests.error_responses import answer
from adaptive_spec.requests.forwarding.keepalive import PrefillKeepAlive
from adaptive_spec.requests.forwarding.outcome import SHUTDOWN, Outcome
from adaptive_spec.requests.forwarding.relay import (
    ERROR_BODY_LIMIT,
    HOP_BY_HOP,
    Answering,
    Relay,
    end_stream_with_error,
    relay_answer,
)
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
from adaptive_spec.requests.gemini.reply import GeminiAnswer
from adaptive_spec.requests.gemini.request import GeminiCall
from adaptive_spec.streams.meter import ResponseMeter

# Dropped from requests: llama-server must send identity-encoded bytes, so the SSE stays parseable in flight.
_DROP_REQUEST = HOP_BY_HOP | {"host", "content-length", "accept-encoding", PROFILE_HEADER}
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
class Via:
    """What the proxy around a forward gives it, made once per forward by the sending stage: the client sessions it
    sends with (the pooled one, and one for a single fresh connection); `keepalive`, a streamed request's keep-alives
    while the server has not answered (requests/forwarding/keepalive.py); `progress`, called after each relayed chunk;
    `shutting_down`, whether a cancellation is the shutdown's (the client is told so) rather than the client's own
    disconnect; `stranded`, where the request is booked while it waits on the server, so the health poll can end it
    if that server stops answering."""

    clients: tuple[aiohttp.ClientSession, aiohttp.ClientSession]
    keepalive: PrefillKeepAlive | None = None
    progress: Callable[[], None] | None = None
    shutting_down: Callable[[], bool] = _never
    stranded: StrandedRequests | None = None


async def forward(
    request: web.Request, out: Forwarding, meter: ResponseMeter, via: Via
) -> tuple[web.StreamResponse, Outcome]:
    """Send `out` upstream `via` the proxy's clients and relay the answer, filling `meter` (the sending stage's, for
    this forward); upstream faults become errors, never exceptions."""
    upstream, timeout, keepalive, sessions = out.upstream, out.timeout, via.keepalive, via.clients
    url = upstream.base_url + out.path_qs
    headers = upstream_headers(request.headers, hidden_headers(request))
    reply = GeminiAnswer(call.model, stream=call.stream, sse=call.sse) if (call := out.gemini) is not None else None
    relay = Relay(upstream, out.api, meter, out.started, out.strip, via.progress, Answering(), reply)
    book = via.stranded or StrandedRequests()
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
            ended = _taken_back(via.shutting_down, booking)
            if ended is None:
                raise
            return await _ended(request, ended, keepalive, relay)


async def _answered(
    request: web.Request,
    upstream_resp: aiohttp.ClientResponse,
    relay: Relay,
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
        resp, client_gone, failure = await relay_answer(request, upstream_resp, relay, extra_headers, committed, head)
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
    request: web.Request, ended: Outcome, keepalive: PrefillKeepAlive | None, relay: Relay
) -> tuple[web.StreamResponse, Outcome]:
    """The answer to a request the proxy ended, as far as it had got: before the headers of the server's answer
    went out, as a failure before the answer (a pool may still fail it over); after, its stream's error event, or for
    a body the connection closed (its length was promised)."""
    resp = relay.answering.response
    if resp is None or not resp.prepared:
        return await _failed(ended, keepalive)
    message, code = ended.error or "", ended.code or ""
    if resp.content_type == "text/event-stream" or (relay.reply is not None and relay.reply.stream):
        await end_stream_with_error(resp, relay, message, code)
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
        text = (await upstream_resp.content.read(ERROR_BODY_LIMIT)).decode(errors="replace")
    except (aiohttp.ClientError, TimeoutError) as exc:
        text = repr(exc)
    message = f"profile {upstream.name!r} at {upstream.base_url} answered {upstream_resp.status}: {text[:1000]}"
    overflow = anthropic_overflow(text.encode()) if keepalive.api is Api.MESSAGES else None
    if overflow is not None:  # the overflow as Anthropic words it, in its stream's error event; its code recorded
        code = overflow["error"]["type"]
        return await keepalive.end_with_event(overflow), Outcome(upstream_resp.status, message, code)
    resp = await keepalive.end_with_error(message, "upstream_error")
    return resp, Outcome(upstream_resp.status, message, "upstream_error")
