"""The connections the proxy holds: bounds on how long a client may take to send a request's headers and its body, a
cap on how many connections are held at once, and HTTP that aiohttp cannot parse answered in the API's error shape.

aiohttp 3.14 bounds neither the time to send headers or a body nor the number of connections (its keep-alive timer
closes only idle ones, and a fresh connection's at the keep-alive timeout), so one local process sending headers a
byte at a time could take every file descriptor. Here each connection's handler is a `RequestHandler` subclass (made
by `WatchedSite`: aiohttp's sites and `Server` take no handler class) that reports when it opens, receives bytes and
closes, and answers framing errors as JSON; the outermost middleware reports when a request's headers are in, its
body is (the payload's end) and its handler is done. The pure `ConnectionBook` keeps each connection's phase and
since when; a sweep closes those past their phase's bound, and a connection past the cap closes, in this order, the
one that has been sending its request the longest, the longest idle one, or itself. A connection whose request is
being answered (a long stream) is never closed by any of this; idle keep-alive is aiohttp's own `keepalive_timeout`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Hashable
from dataclasses import replace
from typing import Any, TypeVar

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from adaptive_spec.proxy.connection_book import ConnectionBook, ConnectionLimits, descriptor_budget
from adaptive_spec.requests.error_responses import error_response

__all__ = ["ConnectionWatch", "WatchedSite", "watch_connections"]
log = logging.getLogger(__name__)
K = TypeVar("K", bound=Hashable)
_REPORT_INTERVAL_S = 10.0
_BACKLOG = 128  # as serve's listen(): connections made while the profiles load wait there


def fit_to_descriptors(limits: ConnectionLimits) -> ConnectionLimits:
    """The limits, with the cap lowered if this process cannot have the descriptors it needs; raises the soft
    RLIMIT_NOFILE towards the hard one when that is enough (as Go's runtime does for every program)."""
    try:
        import resource
    except ImportError:  # Windows: no such limit
        return limits
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limits
    cap, wanted = descriptor_budget(limits.max_connections, soft, None if hard == resource.RLIM_INFINITY else hard)
    if wanted > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError):  # macOS refuses more than its per-process maximum
            cap = descriptor_budget(limits.max_connections, soft, soft)[0]
    return replace(limits, max_connections=cap)


def watch_connections(app: web.Application, limits: ConnectionLimits, say: Callable[[str], None]) -> ConnectionWatch:
    """The watch over `app`'s connections (`WatchedSite` makes them), within what this process's descriptors allow."""
    fitted = fit_to_descriptors(limits)
    if fitted.max_connections < limits.max_connections:
        say(
            f"--max-connections {limits.max_connections} needs more file descriptors than this process may open "
            f"(ulimit -n): at most {fitted.max_connections} connections"
        )
    say(fitted.describe())
    watch = ConnectionWatch(fitted)
    watch.install(app)
    return watch


class ConnectionWatch:
    """The book's shell: fed by the handlers and the outermost middleware, it closes what the book says and reports
    what it closed in a line per burst."""

    def __init__(self, limits: ConnectionLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.book: ConnectionBook[web.RequestHandler] = ConnectionBook(limits)
        self._clock = clock
        self._reported: Counter[str] = Counter()

    def install(self, app: web.Application) -> None:
        """The middleware that sees every request first, and the sweep as a background task of the app."""
        app.middlewares.insert(0, self._middleware())
        app.cleanup_ctx.append(self._sweeping)

    def handler(self, manager: web.Server, loop: asyncio.AbstractEventLoop) -> web.RequestHandler:
        # access_log=None: no access log (the request records are the proxy's own).
        options: dict[str, Any] = {"keepalive_timeout": self.limits.keepalive_timeout_s, "access_log": None}
        return _WatchedHandler(manager, self, loop=loop, **options)

    def opened(self, handler: web.RequestHandler) -> None:
        victim = self.book.opened(handler, self._clock())
        if victim is not None:
            victim.force_close()

    def bytes_received(self, handler: web.RequestHandler) -> None:
        self.book.bytes_received(handler, self._clock())

    def closed(self, handler: web.RequestHandler) -> None:
        self.book.closed(handler)

    def _middleware(self) -> Middleware:
        book, clock = self.book, self._clock

        @web.middleware
        async def watched(request: web.Request, handler: Handler) -> web.StreamResponse:
            key = request.protocol
            book.headers_received(key, clock(), request.content.is_eof())
            request.content.on_eof(lambda: book.body_received(key, clock()))
            try:
                return await handler(request)
            finally:
                book.answered(key, clock())

        return watched

    async def _sweeping(self, _app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(self._sweep())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _sweep(self) -> None:
        interval_s = max(0.05, min(1.0, self.limits.header_timeout_s / 4, self.limits.body_timeout_s / 4))
        last_report = self._clock()
        while True:
            await asyncio.sleep(interval_s)
            for handler in self.book.expired(self._clock()):
                handler.force_close()
            if self._clock() - last_report >= _REPORT_INTERVAL_S:
                last_report = self._clock()
                self._report()

    def _report(self) -> None:
        new = self.book.closed_for - self._reported
        self._reported = Counter(self.book.closed_for)
        parts = {
            "headers": f"{new['headers']} that had not sent their headers within {self.limits.header_timeout_s:g} s",
            "body": f"{new['body']} that had not sent their body within {self.limits.body_timeout_s:g} s",
            "room": f"{new['room']} to stay within --max-connections {self.limits.max_connections}",
        }
        said = [text for reason, text in parts.items() if new[reason]]
        if said:
            log.warning("closed %s (%d connections open)", ", ".join(said), len(self.book))


class _WatchedHandler(web.RequestHandler):
    """aiohttp's connection handler, reporting to the watch, and answering what it cannot parse in the API's shape."""

    __slots__ = ("_watch",)

    def __init__(self, manager: web.Server, watch: ConnectionWatch, **options: Any) -> None:
        super().__init__(manager, **options)
        self._watch = watch

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._watch.opened(self)

    def data_received(self, data: bytes) -> None:
        if data:  # aiohttp feeds itself b"" to parse what it had held back: no new bytes
            self._watch.bytes_received(self)
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._watch.closed(self)
        super().connection_lost(exc)

    def handle_error(
        self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        # aiohttp's own first: it logs (the gate's filter keeps malformed HTTP to a line per burst) and refuses when
        # an answer has begun; its plain-text answer is replaced.
        super().handle_error(request, status, exc, message)
        response = framing_error(status, exc, message)
        response.force_close()
        return response


def framing_error(status: int, exc: BaseException | None, message: str | None) -> web.Response:
    """The JSON answer to a request aiohttp could not parse (400), or whose handler failed outside the proxy's own
    error handling (500, or 504 for a TimeoutError that escaped it)."""
    if status >= 500:
        what = "timed out" if status == 504 else "failed"
        text = f"the proxy {what} answering this request (its log says why)"
        return error_response(status, text, code="timeout" if status == 504 else "internal_error", type_="server_error")
    # One code: aiohttp's C parser reports most faults as a plain BadHttpMessage, its message says which.
    text = " ".join(str(message or getattr(exc, "message", "") or "cannot be parsed").split())
    return error_response(status, f"malformed HTTP request: {text}", code="malformed_http")


class WatchedSite(web.BaseSite):
    """A listening socket whose connections `watch` makes (aiohttp's SockSite makes its plain ones)."""

    __slots__ = ("_name", "_owner", "_sock", "_watch")

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, watch: ConnectionWatch) -> None:
        super().__init__(runner, backlog=_BACKLOG)
        self._sock, self._watch, self._owner = sock, watch, runner
        host, port = sock.getsockname()[:2]
        self._name = f"http://{f'[{host}]' if ':' in host else host}:{port}"

    @property
    def name(self) -> str:
        return self._name

    async def start(self) -> None:
        await super().start()  # registers the site with its runner, which stops it on cleanup
        manager = self._owner.server
        assert manager is not None, "runner.setup() first"
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: self._watch.handler(manager, loop), sock=self._sock, backlog=_BACKLOG
        )
