"""`adaptive-spec kv-relay`: the service beside a remote llama-server that serves and receives its slot files.

Every route needs the key (`Authorization: Bearer KEY`, compared in constant time) and an allowed `Host`; slot files
are named by one plain file name inside `--slot-dir`; bodies stream both ways, checksummed (sha256) and bounded
(`--max-bytes`); every route that moves KV names the model its caller runs, and a different GGUF is refused with
both hashes. Errors are OpenAI-shaped JSON. Slot files (`as-*`) that a delete never reached go after 5 minutes; when
the relay starts, all of them go, with any partial upload.

    GET    /relay/model              the GGUF's sha256, name and size; whether a llama-server is behind the relay
    GET    /relay/probe?bytes=N      N bytes (at most 8 MiB), to measure the link
    GET    /relay/slots/{name}       download (its sha256 in x-adaptive-spec-sha256)
    PUT    /relay/slots/{name}       upload (x-adaptive-spec-sha256 required; a partial file is never visible)
    DELETE /relay/slots/{name}
    POST   /relay/prefill            prefill a prompt on the llama-server and save its slot (`relay/prefill.py`)
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import logging
import os
import stat
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import orjson
from aiohttp import web

from adaptive_spec.access.rules import AccessPolicy, host_allowed, key_accepted, sent_keys
from adaptive_spec.kv.slot_files import (
    MODEL_HEADER,
    SHA256_HEADER,
    SLOT_FILE_PREFIX,
    model_mismatch,
    valid_relay_name,
    valid_sha256,
)

log = logging.getLogger(__name__)
_CHUNK = 1 << 20
_MAX_PROBE_BYTES = 8 << 20
_PARTIAL_PREFIX = ".part-"  # hidden: no valid name can reach a file being written
STALE_SLOT_FILE_S = 300.0  # as the proxy's sweep of its own slot directory (kv/effects.py)
_SWEEP_EVERY_S = 60.0
# Test-only: throttle every body the relay sends or receives to this many bytes per second (a slow link on loopback).
RATE_ENV = "ADAPTIVE_SPEC_RELAY_TEST_RATE_BPS"


@dataclass(frozen=True, slots=True)
class RelaySettings:
    slot_dir: Path
    model_name: str
    model_bytes: int
    model_sha256: str
    access: AccessPolicy
    server_url: str | None = None  # the llama-server whose --slot-save-path is slot_dir
    max_bytes: int = 64 << 30
    prefill_timeout_s: float = 3600.0
    rate_bytes_per_s: float | None = None  # test-only throttle


SETTINGS = web.AppKey("relay_settings", RelaySettings)
NAME_RULE = f"a slot file name is one plain file name starting {SLOT_FILE_PREFIX!r}: [A-Za-z0-9_.-]{{1,128}}"


def error(status: int, message: str, code: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "upstream_error"
    body = orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}})
    return web.Response(status=status, body=body, content_type="application/json")


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _gate(request: web.Request, handler: Handler) -> web.StreamResponse:
    access = request.app[SETTINGS].access
    if not host_allowed(access, request.headers.get("Host")):
        return error(403, "this Host is not one the relay answers to (kv-relay --allow-host)", "host_not_allowed")
    if not key_accepted(access, sent_keys(request.headers.get("Authorization"), request.headers.get("x-api-key"))):
        return error(401, "a valid key is required: Authorization: Bearer KEY", "invalid_api_key")
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # aiohttp's own refusals (no such route, wrong method, body too large) in the same shape as ours.
        return error(exc.status, exc.reason, f"http_{exc.status}")
    except OSError as exc:
        # Named in the relay's log, not to the caller: the message would carry the slot directory's path.
        log.warning("kv-relay: %s %s failed: %s", request.method, request.path, exc)
        if exc.errno == errno.ENOSPC:
            return error(507, "the relay's slot directory is out of space", "no_space")
        return error(500, f"the relay could not use its slot directory ({exc.strerror or type(exc).__name__})", "io")


def check_model(request: web.Request) -> web.Response | None:
    """KV moves only between servers running the same GGUF: the caller names its model's sha256."""
    theirs = request.headers.get(MODEL_HEADER, "").strip().lower()
    if not valid_sha256(theirs):
        return error(400, f"{MODEL_HEADER} must carry the sha256 of the caller's GGUF", "model_hash_required")
    settings = request.app[SETTINGS]
    problem = model_mismatch(settings.model_sha256, theirs, f"the relay's server ({settings.model_name})")
    return error(409, problem, "model_mismatch") if problem else None


def _slot_path(request: web.Request, same_model: bool = False) -> Path | web.Response:
    """The slot file the request names, or the refusal: a name a relay does not handle, or (`same_model`) a
    sender whose model is not this relay's."""
    name = request.match_info["name"]
    if not valid_relay_name(name):
        return error(400, NAME_RULE, "bad_name")
    refused = check_model(request) if same_model else None
    return refused if refused is not None else request.app[SETTINGS].slot_dir / name


class Throttle:
    """Test-only: sleeps so that at most `rate` bytes pass per second."""

    def __init__(self, rate: float | None) -> None:
        self.rate, self.sent, self.t0 = rate, 0, time.monotonic()

    async def passed(self, n: int) -> None:
        if not self.rate:
            return
        self.sent += n
        ahead = self.sent / self.rate - (time.monotonic() - self.t0)
        if ahead > 0:
            await asyncio.sleep(ahead)


async def _model(request: web.Request) -> web.Response:
    s = request.app[SETTINGS]
    return web.json_response(
        {"sha256": s.model_sha256, "model": s.model_name, "bytes": s.model_bytes, "server": s.server_url is not None}
    )


async def _probe(request: web.Request) -> web.StreamResponse:
    try:
        n = int(request.query.get("bytes", "0"))
    except ValueError:
        n = -1
    if not 0 <= n <= _MAX_PROBE_BYTES:
        return error(400, f"bytes must be 0..{_MAX_PROBE_BYTES}", "bad_probe")
    resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
    resp.content_length = n
    await resp.prepare(request)
    throttle, block = Throttle(request.app[SETTINGS].rate_bytes_per_s), bytes(min(n, 65536))
    left = n
    while left > 0:
        piece = block[: min(left, len(block))]
        await resp.write(piece)
        await throttle.passed(len(piece))
        left -= len(piece)
    await resp.write_eof()
    return resp


async def _download(request: web.Request) -> web.StreamResponse:
    path = _slot_path(request, same_model=True)
    if isinstance(path, web.Response):
        return path
    # Opened before hashing: a delete racing this download cannot leave the headers promising a missing file.
    fh = await asyncio.to_thread(_open_regular, path)
    if fh is None:
        return error(404, f"no slot file {path.name!r}", "not_found")
    try:
        size, digest = await asyncio.to_thread(_size_and_sha256, fh)
        await asyncio.to_thread(fh.seek, 0)
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream", SHA256_HEADER: digest})
        resp.content_length = size
        await resp.prepare(request)
        throttle = Throttle(request.app[SETTINGS].rate_bytes_per_s)
        while chunk := await asyncio.to_thread(fh.read, _CHUNK):
            await resp.write(chunk)
            await throttle.passed(len(chunk))
    finally:
        fh.close()
    await resp.write_eof()
    return resp


async def _upload(request: web.Request) -> web.Response:
    path = _slot_path(request, same_model=True)
    if isinstance(path, web.Response):
        return path
    expected = request.headers.get(SHA256_HEADER, "").strip().lower()
    if not valid_sha256(expected):
        return error(400, f"{SHA256_HEADER} must carry the file's sha256 (64 hex digits)", "checksum_required")
    limit = request.app[SETTINGS].max_bytes
    if request.content_length is not None and request.content_length > limit:
        return error(413, f"the slot file is larger than the relay's limit of {limit} bytes", "too_large")
    partial = path.with_name(f"{_PARTIAL_PREFIX}{uuid.uuid4().hex}")
    try:
        size, digest = await _receive(request, partial, limit)
        if size > limit:
            return error(413, f"the slot file is larger than the relay's limit of {limit} bytes", "too_large")
        if digest != expected:
            return error(422, f"checksum mismatch: received sha256 {digest}, expected {expected}", "checksum_mismatch")
        await asyncio.to_thread(os.replace, partial, path)
    finally:
        await asyncio.to_thread(partial.unlink, True)
    return web.json_response({"name": path.name, "bytes": size, "sha256": digest}, status=201)


async def _receive(request: web.Request, partial: Path, limit: int) -> tuple[int, str]:
    """Write the body to `partial`, hashing it; stops reading once past `limit` (returns a size over it)."""
    digest, size = hashlib.sha256(), 0
    throttle = Throttle(request.app[SETTINGS].rate_bytes_per_s)
    fh: BinaryIO = await asyncio.to_thread(partial.open, "wb")
    try:
        async for chunk in request.content.iter_chunked(_CHUNK):
            size += len(chunk)
            if size > limit:
                return size, ""
            digest.update(chunk)
            await asyncio.to_thread(fh.write, chunk)
            await throttle.passed(len(chunk))
    finally:
        fh.close()
    return size, digest.hexdigest()


async def _delete(request: web.Request) -> web.Response:
    path = _slot_path(request)
    if isinstance(path, web.Response):
        return path
    if not await asyncio.to_thread(_deletable, path):
        return error(404, f"no slot file {path.name!r}", "not_found")
    try:
        await asyncio.to_thread(path.unlink)
    except FileNotFoundError:
        return error(404, f"no slot file {path.name!r}", "not_found")
    return web.Response(status=204)


def _deletable(path: Path) -> bool:
    """A file or a symbolic link (the link goes, not what it points to); never a directory or a FIFO."""
    try:
        mode = path.lstat().st_mode
    except OSError:
        return False
    return stat.S_ISREG(mode) or stat.S_ISLNK(mode)


def _open_regular(path: Path) -> BinaryIO | None:
    """The slot file opened for reading, or None when there is no regular file of that name. A symbolic link is
    not followed (whoever can write in the slot directory could point one at any file the relay can read), and a
    FIFO or device is neither waited on nor read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.EISDIR, errno.ENOTDIR, errno.ENXIO, errno.EACCES):
            return None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def _size_and_sha256(fh: BinaryIO) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    while chunk := fh.read(4 * _CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


def sweep_partials(slot_dir: Path) -> None:
    """At start, what a relay that crashed or was killed left behind: hidden partial uploads, and the slot files of
    the moves it was serving (a move deletes its file through the relays at its end, which cannot reach a relay that
    is down). A move under way as the relay starts loses its file and re-prefills, as it would have with the relay
    down."""
    for leftover in slot_dir.glob(f"{_PARTIAL_PREFIX}*"):
        leftover.unlink(missing_ok=True)
    sweep_slot_files(slot_dir, older_than_s=0.0)


def sweep_slot_files(slot_dir: Path, older_than_s: float = STALE_SLOT_FILE_S) -> int:
    """Delete the slot files (`as-*` names only; others are never touched) not written for `older_than_s`: those
    whose delete never reached the relay (the proxy gave up on a relay that stalled, or could not reach it). One
    being read is unaffected: an open file outlives its name. Returns how many went."""
    now, gone = time.time(), 0
    for path in slot_dir.glob(f"{SLOT_FILE_PREFIX}*"):
        try:
            if valid_relay_name(path.name) and _deletable(path) and now - path.lstat().st_mtime >= older_than_s:
                path.unlink()
                gone += 1
        except OSError:
            continue
    return gone


async def _sweeper(app: web.Application) -> AsyncIterator[None]:
    """`sweep_slot_files` every `_SWEEP_EVERY_S` while the relay runs."""
    slot_dir = app[SETTINGS].slot_dir

    async def loop() -> None:
        while True:
            await asyncio.sleep(_SWEEP_EVERY_S)
            try:
                gone = await asyncio.to_thread(sweep_slot_files, slot_dir)
            except OSError as exc:  # the directory itself unreadable: said, and tried again next time
                log.warning("kv-relay: could not sweep the slot directory: %s", exc.strerror or type(exc).__name__)
                continue
            if gone:
                log.warning("kv-relay: deleted %d slot files left over for %.0f s or more", gone, STALE_SLOT_FILE_S)

    task = asyncio.create_task(loop())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def build_relay_app(settings: RelaySettings, extra_routes: list[Any] | None = None) -> web.Application:
    # Slot files stream through request.content; nothing here reads a whole body through aiohttp's own limit.
    app = web.Application(middlewares=[_gate], client_max_size=1 << 20)
    app[SETTINGS] = settings
    app.router.add_get("/relay/model", _model)
    app.router.add_get("/relay/probe", _probe)
    app.router.add_get("/relay/slots/{name}", _download)
    app.router.add_put("/relay/slots/{name}", _upload)
    app.router.add_delete("/relay/slots/{name}", _delete)
    app.router.add_routes(extra_routes or [])
    app.cleanup_ctx.append(_sweeper)
    return app
