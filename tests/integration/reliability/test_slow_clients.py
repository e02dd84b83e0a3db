"""Slow and idle clients against a real `serve` in its own process, in front of a REAL llama-server (tiny model), with
short bounds: a request's headers and body must arrive within theirs, an idle keep-alive connection is closed, many
slow connections do not keep an ordinary request out, answers (a long stream, the event feed) are never cut, and HTTP
aiohttp cannot parse is answered in the API's error shape. Also the pure connection book, table by table."""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.processes.servers import LlamaServer, ProxyProcess

HEADER_S, BODY_S, KEEPALIVE_S, MAX_CONNECTIONS = 1.0, 1.5, 4.0, 100
SLACK_S = 3.0  # the sweep's granularity and a loaded machine's delays; the bounds themselves are checked from below
CHAT = {"model": "m", "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def proxy(tiny_server: LlamaServer) -> Iterator[ProxyProcess]:
    proc = ProxyProcess(
        "--profile",
        f"plain={tiny_server.url}",
        *("--header-timeout", str(HEADER_S), "--body-timeout", str(BODY_S)),
        *("--keepalive-timeout", str(KEEPALIVE_S), "--max-connections", str(MAX_CONNECTIONS)),
    )
    yield proc
    proc.stop()


def _connect(proxy: ProxyProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", proxy.port), timeout=30)


def _until_closed(sock: socket.socket, limit_s: float) -> tuple[float, bytes]:
    """Seconds until the proxy closes `sock` (whatever it sent before), reading all the while."""
    started = time.monotonic()
    sock.settimeout(limit_s)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return time.monotonic() - started, got


def _answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One answer with a Content-Length, read off a connection that stays open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def _chat(proxy: ProxyProcess, body: dict[str, object], timeout: float = 60) -> bytes:
    req = urllib.request.Request(
        proxy.base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        assert resp.status == 200
        return bytes(resp.read())


def _held(proxy: ProxyProcess) -> int:
    """Client connections the proxy holds: ESTABLISHED sockets on its port that are its own descriptors."""
    pid = proxy.proc.pid
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    held = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            held += f[3] == "01" and int(f[1].rsplit(":", 1)[1], 16) == proxy.port and f[9] in inodes
    return held


# --- the bounds on receiving a request --------------------------------------------------------------------------------


def test_a_header_sent_a_byte_at_a_time_is_closed_within_the_header_bound(proxy: ProxyProcess) -> None:
    with _connect(proxy) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        sock.settimeout(0.2)
        closed = False
        for byte in b"X-Slow: " + b"a" * 100:  # bytes keep coming: the bound is on the whole header, not on silence
            try:
                sock.sendall(bytes([byte]))
                closed = sock.recv(1) == b""
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
            if closed:
                break
        elapsed = time.monotonic() - started
    assert closed, "the connection outlived its header bound"
    assert HEADER_S * 0.9 <= elapsed <= HEADER_S + SLACK_S


def test_a_connection_that_sends_nothing_is_closed_within_the_header_bound(proxy: ProxyProcess) -> None:
    with _connect(proxy) as sock:
        elapsed, got = _until_closed(sock, 30)
    assert got == b"" and HEADER_S * 0.9 <= elapsed <= HEADER_S + SLACK_S


def test_a_slow_body_is_closed_within_the_body_bound(proxy: ProxyProcess) -> None:
    with _connect(proxy) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 200\r\n\r\n" + b'{"model": "m", '
        )
        elapsed, got = _until_closed(sock, 30)
    assert got == b"" and BODY_S * 0.9 <= elapsed <= BODY_S + SLACK_S
    assert "Traceback" not in proxy.log()


def test_an_idle_keepalive_connection_is_closed_after_the_keepalive_bound(proxy: ProxyProcess) -> None:
    with _connect(proxy) as sock:
        sock.sendall(b"GET /adaptive/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        status, headers, _ = _answer(sock)
        assert status == 200 and headers.get("connection", "keep-alive").lower() != "close"
        elapsed, got = _until_closed(sock, 30)
    assert got == b"" and KEEPALIVE_S * 0.9 <= elapsed <= KEEPALIVE_S + SLACK_S


def test_a_kept_alive_connections_next_request_has_the_header_bound(proxy: ProxyProcess) -> None:
    with _connect(proxy) as sock:
        sock.sendall(b"GET /adaptive/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert _answer(sock)[0] == 200
        time.sleep(0.5)
        sock.sendall(b"GET /adaptive/health HTTP/1.1\r\nHost: 127.0.")  # half of the next request
        elapsed, got = _until_closed(sock, 30)
    assert got == b"" and HEADER_S * 0.9 <= elapsed < KEEPALIVE_S - 0.5


def test_many_slow_connections_do_not_keep_an_ordinary_request_out(proxy: ProxyProcess) -> None:
    slow = []
    try:
        for _ in range(3 * MAX_CONNECTIONS):
            sock = _connect(proxy)
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            slow.append(sock)
        started = time.monotonic()
        reply = json.loads(_chat(proxy, CHAT, timeout=30))
        assert reply["choices"], reply
        # Answered promptly (far sooner than the slow ones' header bound would have freed room), and never more
        # connections held than the cap (those closed to make room may still be on their way out).
        assert time.monotonic() - started < HEADER_S + SLACK_S
        assert _held(proxy) <= MAX_CONNECTIONS + 5
    finally:
        for sock in slow:
            sock.close()


# --- answers are never bounded ---------------------------------------------------------------------------------------


def test_a_long_streamed_answer_is_not_cut(proxy: ProxyProcess) -> None:
    # The tiny model's context is 4096 tokens: 3500 of them take a few seconds on one thread, longer than any bound.
    body = {**CHAT, "max_tokens": 3500, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    started = time.monotonic()
    events = [line for line in _chat(proxy, body, timeout=300).split(b"\n") if line.startswith(b"data: ")]
    elapsed = time.monotonic() - started
    assert events[-1] == b"data: [DONE]"
    assert json.loads(events[-2][6:])["usage"]["completion_tokens"] == 3500
    assert elapsed > BODY_S, f"the stream took {elapsed:.1f} s: too short to show that it outlives the bounds"


def test_the_event_feed_outlives_every_bound(proxy: ProxyProcess) -> None:
    with _connect(proxy) as sock:
        sock.sendall(b"GET /adaptive/events HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/event-stream\r\n\r\n")
        sock.settimeout(30)
        got = sock.recv(65536)
        assert b" 200 " in got.split(b"\r\n", 1)[0]
        time.sleep(KEEPALIVE_S + 1)  # past the header, body and keep-alive bounds, with nothing sent either way
        _chat(proxy, CHAT)
        sock.settimeout(10)
        later = b""
        while b"event: RequestFinished" not in later:
            chunk = sock.recv(65536)
            assert chunk, "the feed was closed"
            later += chunk


# --- HTTP aiohttp cannot parse --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nBad Header: x\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: -1\r\n\r\n{}",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"zz\r\n{}\r\n0\r\n\r\n",
    ],
    ids=["request line", "header", "content-length", "chunk size"],
)
def test_malformed_http_gets_the_api_error_shape(proxy: ProxyProcess, raw: bytes) -> None:
    with _connect(proxy) as sock:
        sock.sendall(raw)
        _, got = _until_closed(sock, 30)
    head, _, body = got.partition(b"\r\n\r\n")
    assert b" 400 " in head.split(b"\r\n", 1)[0] and b"application/json" in head
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "malformed_http"
    assert error["message"].startswith("malformed HTTP request: ")


def test_a_bad_chunk_after_the_body_began_is_closed_within_the_body_bound(proxy: ProxyProcess) -> None:
    """aiohttp 3.14's C parser drops the payload of a request already being handled when a later chunk is malformed,
    without an error: the handler would wait for the rest forever. The body bound ends it (with no answer: aiohttp
    queues its 400 behind the request that never ends)."""
    with _connect(proxy) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
            b"Content-Type: application/json\r\n\r\n2\r\n{}\r\n"
        )
        time.sleep(0.3)
        sock.sendall(b"zz\r\n0\r\n\r\n")
        elapsed, got = _until_closed(sock, 30)
    assert got == b"" and elapsed <= BODY_S + SLACK_S


# --- the pure book ---------------------------------------------------------------------------------------------------
