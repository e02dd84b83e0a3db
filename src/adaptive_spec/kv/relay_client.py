"""The caller's side of a kv-relay: its model's hash, a probe of the link, a remote prefill, and a slot file brought
home (streamed into a hidden partial file, its sha256 checked, then renamed) and deleted over there."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import aiohttp
import orjson

from adaptive_spec.kv.slot_files import MODEL_HEADER, SHA256_HEADER, valid_sha256

_CHUNK = 1 << 20
_MAX_ANSWER_BYTES = 1 << 20  # a relay's JSON answers are small: a larger one is not read into memory
_MAX_MESSAGE_CHARS = 300  # a relay's words go into reason lines, records and logs
PARTIAL_PREFIX = ".part-dl-"  # hidden downloads in progress; what a crash leaves is swept at start
STALL_S = 60.0  # a download that sends nothing for this long is given up


class RelayError(Exception):
    """The relay refused or failed; the message names what and where, `code` says it in one word."""

    def __init__(self, message: str, code: str = "relay") -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Prefilled:
    slot: int
    prompt_n: int
    cache_n: int
    prompt_ms: float
    n_saved: int
    n_written: int
    save_ms: float
    elapsed_ms: float  # the whole call, as the relay measured it


@dataclass(frozen=True, slots=True)
class Downloaded:
    bytes: int
    seconds: float
    sha256: str


class RelayClient:
    def __init__(self, base_url: str, key: str, model_sha256: str) -> None:
        self.base_url, self.model_sha256 = base_url.rstrip("/"), model_sha256
        self._headers = {"Authorization": f"Bearer {key}", MODEL_HEADER: model_sha256}

    async def _json(self, resp: aiohttp.ClientResponse, what: str) -> dict[str, Any]:
        text = await _bounded_text(resp)
        if resp.status >= 300:
            raise RelayError(f"{what} at {self.base_url}: HTTP {resp.status}: {_message(text)}")
        try:
            body = orjson.loads(text) if text else {}
        except orjson.JSONDecodeError:
            body = None
        if not isinstance(body, dict):
            # What answered may be no relay at all (another service on the port): its words, one short line.
            raise RelayError(f"{what} at {self.base_url}: not a relay's answer: {_clean(text[:80])}", "bad_answer")
        return body

    async def model(self, client: aiohttp.ClientSession) -> tuple[dict[str, Any], float]:
        """The relay's model (sha256, name, size) and the call's round trip in seconds."""
        t0 = time.perf_counter()
        async with client.get(f"{self.base_url}/relay/model", headers=self._headers, timeout=_timeout(30)) as resp:
            body = await self._json(resp, "GET /relay/model")
        return body, time.perf_counter() - t0

    async def probe(self, client: aiohttp.ClientSession, n_bytes: int) -> float:
        """Bytes per second of a timed download of `n_bytes`."""
        t0 = time.perf_counter()
        url = f"{self.base_url}/relay/probe?bytes={n_bytes}"
        async with client.get(url, headers=self._headers, timeout=_timeout(120)) as resp:
            if resp.status != 200:
                raise RelayError(f"probe at {self.base_url}: HTTP {resp.status}")
            got = 0
            async for chunk in resp.content.iter_chunked(_CHUNK):
                got += len(chunk)
                if got >= n_bytes:
                    break  # all that was asked for: a relay that sends on is not listened to
        return got / max(1e-6, time.perf_counter() - t0)

    async def prefill(
        self, client: aiohttp.ClientSession, path: str, body: dict[str, Any], filename: str, timeout_s: float
    ) -> Prefilled:
        payload = orjson.dumps({"path": path, "body": body, "filename": filename})
        headers = {**self._headers, "Content-Type": "application/json"}
        url = f"{self.base_url}/relay/prefill"
        async with client.post(url, data=payload, headers=headers, timeout=_timeout(timeout_s)) as resp:
            answer = await self._json(resp, "remote prefill")
        timings = answer.get("timings") or {}
        return Prefilled(
            slot=int(answer.get("slot") or 0),
            prompt_n=int(timings.get("prompt_n") or 0),
            cache_n=int(timings.get("cache_n") or 0),
            prompt_ms=float(timings.get("prompt_ms") or 0.0),
            n_saved=int(answer.get("n_saved") or 0),
            n_written=int(answer.get("n_written") or 0),
            save_ms=float(answer.get("save_ms") or 0.0),
            elapsed_ms=float(answer.get("elapsed_ms") or 0.0),
        )

    async def download(
        self, client: aiohttp.ClientSession, name: str, dest: Path, max_bytes: int, timeout_s: float
    ) -> Downloaded:
        """Stream the relay's slot file `name` to `dest` (same directory partial file, renamed once its sha256
        matches the relay's header); nothing is left at `dest` on failure. `max_bytes`: the size the relay said it
        saved, or the caller's bound: a relay that announces or sends more is cut off before the disk fills, one
        that stops sending for `STALL_S` is given up."""
        partial = dest.with_name(f"{PARTIAL_PREFIX}{uuid.uuid4().hex}")
        t0 = time.perf_counter()
        url = f"{self.base_url}/relay/slots/{name}"
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_read=STALL_S)
        try:
            async with client.get(url, headers=self._headers, timeout=timeout) as resp:
                if resp.status != 200:
                    raise RelayError(
                        f"download of {name} at {self.base_url}: HTTP {resp.status}: "
                        f"{_message(await _bounded_text(resp))}"
                    )
                expected = resp.headers.get(SHA256_HEADER, "").lower()
                if not valid_sha256(expected):
                    raise RelayError(f"download of {name}: the relay sent no {SHA256_HEADER}")
                if resp.content_length is not None and resp.content_length > max_bytes:
                    raise RelayError(
                        f"download of {name}: {resp.content_length} bytes announced, at most {max_bytes}", "size"
                    )
                await asyncio.to_thread(_room_for, dest.parent, resp.content_length or max_bytes)
                size, digest = await _write(resp, partial, max_bytes)
            if digest != expected:
                raise RelayError(
                    f"download of {name}: sha256 {digest} does not match the relay's {expected}", "checksum"
                )
            await asyncio.to_thread(os.replace, partial, dest)
        finally:
            await asyncio.to_thread(partial.unlink, True)
        return Downloaded(size, time.perf_counter() - t0, digest)

    async def copy_to(
        self, client: aiohttp.ClientSession, name: str, target: RelayClient, max_bytes: int, stall_s: float
    ) -> Downloaded:
        """Stream this relay's slot file `name` into another relay (a PUT carrying this relay's sha256 of it and this
        side's model hash: the target checks both, bounds the size, and keeps nothing partial); nothing is stored on
        the caller's machine. Given up once `stall_s` pass without a byte crossing (or without the target's answer
        after the last): a slow link copies as long as it takes (the router priced the move from the link it
        measured), a pulled cable or a stopped relay is noticed within `stall_s`. Any failure is a RelayError in one
        line naming the relay at fault and how many bytes had crossed."""
        t0 = time.perf_counter()
        passing = _Passing()
        copying = asyncio.ensure_future(self._copy(client, name, target, max_bytes, stall_s, passing))
        try:
            answer = await _unless_stalled(copying, passing, stall_s)
        except TimeoutError:
            raise RelayError(
                f"copy of {name} from {self.base_url} to {target.base_url}: gave up after {stall_s:.1f} s without "
                f"a byte across, {passing.bytes} bytes across",
                "timeout",
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            # Until the source's headers are in, and whenever its body broke off, the source is at fault.
            if not passing.started:
                what = f"the download from {self.base_url} failed"
            elif passing.error is not None:
                what = f"the download from {self.base_url} broke off after {passing.bytes} bytes"
            else:
                what = f"the upload to {target.base_url} broke off after {passing.bytes} bytes"
            raise RelayError(f"copy of {name}: {what}: {_cause(passing.error or exc)}") from exc
        return Downloaded(int(answer.get("bytes") or 0), time.perf_counter() - t0, passing.sha256)

    async def _copy(
        self,
        client: aiohttp.ClientSession,
        name: str,
        target: RelayClient,
        max_bytes: int,
        stall_s: float,
        passing: _Passing,
    ) -> dict[str, Any]:
        # No deadline on the whole copy (a large file on a slow link takes its time: `_unless_stalled` watches the
        # bytes); the source's headers and the target's answer each within `stall_s`.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=stall_s, sock_read=stall_s)
        async with client.get(f"{self.base_url}/relay/slots/{name}", headers=self._headers, timeout=timeout) as resp:
            if resp.status != 200:
                raise RelayError(
                    f"download of {name} at {self.base_url}: HTTP {resp.status}: {_message(await _bounded_text(resp))}"
                )
            expected = resp.headers.get(SHA256_HEADER, "").lower()
            if not valid_sha256(expected):
                raise RelayError(f"download of {name} at {self.base_url}: the answer carries no {SHA256_HEADER}")
            if resp.content_length is not None and resp.content_length > max_bytes:
                raise RelayError(f"the slot file {name} is larger than {max_bytes} bytes")
            passing.started, passing.sha256 = True, expected
            headers = {**target._headers, MODEL_HEADER: self.model_sha256, SHA256_HEADER: expected}
            url = f"{target.base_url}/relay/slots/{name}"
            async with client.put(url, data=passing.chunks(resp), headers=headers, timeout=timeout) as put:
                return await target._json(put, f"upload of {name}")

    async def delete(self, client: aiohttp.ClientSession, name: str, timeout_s: float = 30.0) -> bool:
        url = f"{self.base_url}/relay/slots/{name}"
        async with client.delete(url, headers=self._headers, timeout=_timeout(timeout_s)) as resp:
            return resp.status == 204


class _Passing:
    """A slot file on its way from one relay into another: whether the source's headers came, how many bytes have
    passed, and what cut the source's body off (the upload only sees its own connection fail)."""

    def __init__(self) -> None:
        self.started, self.bytes, self.sha256 = False, 0, ""
        self.error: BaseException | None = None

    async def chunks(self, resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
        try:
            async for chunk in resp.content.iter_chunked(_CHUNK):
                self.bytes += len(chunk)
                yield chunk
        except (aiohttp.ClientError, OSError) as exc:
            self.error = exc
            raise


async def _unless_stalled(copying: asyncio.Future[dict[str, Any]], passing: _Passing, stall_s: float) -> dict[str, Any]:
    """`copying`'s result, or TimeoutError (and `copying` cancelled) once `stall_s` passed with no byte across."""
    last_bytes, last_change = passing.bytes, time.monotonic()
    try:
        while True:
            done, _ = await asyncio.wait({copying}, timeout=stall_s / 4)
            if done:
                return copying.result()
            now = time.monotonic()
            if passing.bytes != last_bytes:
                last_bytes, last_change = passing.bytes, now
            elif now - last_change >= stall_s:
                raise TimeoutError
    finally:
        if not copying.done():
            copying.cancel()
            with contextlib.suppress(asyncio.CancelledError, aiohttp.ClientError, OSError):
                await copying


def _cause(exc: BaseException) -> str:
    """A connection's failure in a few words: aiohttp's own messages run to whole connection keys."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and (seen.errno or seen.strerror):
            return (os.strerror(seen.errno) if seen.errno else str(seen.strerror)).lower()
        seen = seen.__cause__ or seen.__context__
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the connection was closed"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "the body was cut short"
    return _clean(str(exc) or type(exc).__name__)[:120]


async def _write(resp: aiohttp.ClientResponse, partial: Path, max_bytes: int) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    fh: BinaryIO = await asyncio.to_thread(partial.open, "wb")
    try:
        async for chunk in resp.content.iter_chunked(_CHUNK):
            size += len(chunk)
            if size > max_bytes:
                raise RelayError(f"the relay sent more than the {max_bytes} bytes expected", "size")
            digest.update(chunk)
            await asyncio.to_thread(fh.write, chunk)
    finally:
        fh.close()
    return size, digest.hexdigest()


def _room_for(directory: Path, n_bytes: int) -> None:
    """A slot file never takes the last of the disk: refused while at least as much again would stay free."""
    free = shutil.disk_usage(directory).free
    if n_bytes * 2 > free:
        raise RelayError(
            f"a slot file of {n_bytes} bytes would leave too little of the {free} bytes free here", "local_disk"
        )


async def _bounded_text(resp: aiohttp.ClientResponse) -> str:
    """A relay's answer as text, at most `_MAX_ANSWER_BYTES` of it read (a larger one is cut, then fails to parse)."""
    parts, size = [], 0
    async for chunk in resp.content.iter_chunked(64 << 10):
        parts.append(chunk[: _MAX_ANSWER_BYTES - size])
        size += len(parts[-1])
        if size >= _MAX_ANSWER_BYTES:
            break
    return b"".join(parts).decode("utf-8", "replace")


def _clean(text: str) -> str:
    """A relay's words, safe for one line of a record or a log: no control characters, no more than a line."""
    flat = "".join(ch if ch.isprintable() else " " for ch in text)
    return flat if len(flat) <= _MAX_MESSAGE_CHARS else flat[: _MAX_MESSAGE_CHARS - 1] + "…"


def _timeout(total_s: float) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=total_s)


def _message(text: str) -> str:
    """The message of an OpenAI-shaped error body, else the text's start."""
    try:
        body = orjson.loads(text)
        return _clean(str(body["error"]["message"]))
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return _clean(text)
