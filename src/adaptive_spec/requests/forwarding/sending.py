"""Sending one request to a llama-server: on a pooled connection, once more on a fresh one when the pooled one turns
out dead, and every fault before an answer as the Outcome its client is told."""

from __future__ import annotations

from collections.abc import Awaitable

import aiohttp
from multidict import CIMultiDict

from adaptive_spec.llama.upstreams import Upstream
from adaptive_spec.requests.forwarding.outcome import Outcome


async def sent_or_failed(
    sending: Awaitable[aiohttp.ClientResponse],
    upstream: Upstream,
    timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 - aiohttp's per-phase timeouts, not one deadline
) -> aiohttp.ClientResponse | Outcome:
    """The upstream's answer, or the fault before it as an Outcome."""
    try:
        return await sending
    except aiohttp.ClientConnectorError as exc:
        # 503, not 502: nothing answered wrongly, the server is not there (crashed, restarting); the client may try
        # again after Retry-After, and a pool fails the request over first.
        message = f"profile {upstream.name!r} at {upstream.base_url} is unreachable: {exc.os_error or exc}"
        return Outcome(503, message, "upstream_unreachable", unreachable=True)
    except aiohttp.ConnectionTimeoutError:
        message = (
            f"profile {upstream.name!r} at {upstream.base_url} did not accept a connection within "
            f"{timeout.sock_connect} s"
        )
        return Outcome(504, message, "upstream_timeout")
    except TimeoutError:
        message = f"profile {upstream.name!r} at {upstream.base_url} did not answer within {timeout.sock_read} s"
        return Outcome(504, message, "upstream_timeout")
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        # Dropped again on a fresh connection (`send` retried once): a server dying under it (the socket of a
        # SIGKILLed one resets what its backlog held). Nothing was answered: as unreachable.
        message = f"profile {upstream.name!r} at {upstream.base_url} dropped the connection before answering: {exc}"
        return Outcome(503, message, "upstream_unreachable", unreachable=True)
    except aiohttp.ClientError as exc:
        message = f"profile {upstream.name!r} at {upstream.base_url} failed before answering: {exc}"
        return Outcome(502, message, "upstream_error")


async def send(
    sessions: tuple[aiohttp.ClientSession, aiohttp.ClientSession],
    method: str,
    url: str,
    body: bytes,
    headers: CIMultiDict[str],
    timeout: aiohttp.ClientTimeout,  # noqa: ASYNC109 - aiohttp's per-phase timeouts
) -> aiohttp.ClientResponse:
    """One request on the first (pooling) session; sent again once, on the second session's new connection, if the
    server dropped the connection before answering: a pooled keep-alive connection the server had just closed
    ("server disconnected", "can not write request body"), which the request never reached. A refused connection is
    not retried: the profile is down."""
    pooled, fresh = sessions
    try:
        return await pooled.request(method, url, data=body or None, headers=headers, timeout=timeout)
    except aiohttp.ClientConnectorError:
        raise
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
        return await fresh.request(method, url, data=body or None, headers=headers, timeout=timeout)
