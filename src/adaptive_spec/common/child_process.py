"""One child process that runs functions one call at a time, spoken to over a pipe that the event loop watches.

No thread in the proxy's process takes part. A `ProcessPoolExecutor` has a manager thread and a queue feeder thread:
each call woke them, they took the GIL from the event loop (pickling the call, clearing the wake-up pipe), and a
submit waited ~1.5 ms for it under load. Here the event loop pickles the call (the client's bytes and a few values:
a copy, not a walk of a parsed history), writes it to the pipe while the child, idle, reads it, and is woken by the
pipe when the answer is there.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import struct
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any

# A call's pickled size up to which it is written from the event loop: a Unix socket pair holds ~200 KB, so a write
# this small does not wait for the child to read (a 100k-token history is ~350 KB: a blocked write waits for a child
# that runs at a lower priority).
_INLINE_SEND = 64 * 1024


class WorkerDied(Exception):
    """The child process is gone (killed, crashed): the call's work is lost."""


class WorkerFailed(Exception):
    """The function raised in the child process: its exception, as text."""


def _child_main(
    conn: Connection, initializer: Callable[..., None] | None, initargs: tuple[Any, ...], niceness: int = 0
) -> None:
    # Ctrl-C reaches the whole process group: the proxy stops its worker itself (it closes the pipe).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if niceness and hasattr(os, "nice"):
        with contextlib.suppress(OSError):
            os.nice(niceness)
    try:
        if initializer is not None:
            initializer(*initargs)
    except Exception as exc:
        conn.send((False, f"{type(exc).__name__}: {exc}"))
        return
    conn.send((True, "ready"))  # nothing is sent to it before: a call would fill the pipe while it starts
    while True:
        try:
            func, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            answer: tuple[bool, Any] = (True, func(*args))
        except Exception as exc:
            answer = (False, f"{type(exc).__name__}: {exc}")
        try:
            conn.send(answer)
        except (BrokenPipeError, OSError):
            return


class WorkerProcess:
    """Started at construction (spawned: never fork a process that runs threads); `call` one at a time."""

    def __init__(
        self, initializer: Callable[..., None] | None = None, initargs: tuple[Any, ...] = (), niceness: int = 0
    ) -> None:
        """`niceness`: how much lower than the proxy's the child's CPU priority is (background work yields the
        cores to the streams when they are busy; on a free core it runs as fast as ever)."""
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(
            target=_child_main, args=(child, initializer, initargs, niceness), daemon=True, name="adaptive-spec-worker"
        )
        self._process.start()
        child.close()
        self._lock = asyncio.Lock()
        self._ready = False
        self.closed = False

    async def call(self, func: Callable[..., Any], *args: Any) -> Any:
        """`func(*args)` in the child; its exception comes back as WorkerFailed (an initializer's, on the first
        call). A call cancelled while the child works closes the worker (its answer would be taken for the next)."""
        async with self._lock:
            if self.closed:
                raise WorkerDied("the worker process was stopped")
            if not self._ready:
                await self._answer()
                self._ready = True
            payload = ForkingPickler.dumps((func, args))
            try:
                if len(payload) <= _INLINE_SEND:
                    self._conn.send_bytes(payload)
                else:  # more than the pipe may hold: written as the child reads it, the event loop free meanwhile
                    await self._send_large(payload)
            except (BrokenPipeError, OSError) as exc:
                self.close()
                raise WorkerDied(f"the worker process is gone ({exc})") from exc
            except asyncio.CancelledError:
                self.close()  # part of the call may be in the pipe: the child cannot be spoken to any more
                raise
            return await self._answer()

    async def _send_large(self, payload: bytes | memoryview) -> None:
        """`Connection.send_bytes`'s frame (a 4-byte big-endian length, then the bytes), written without blocking:
        the pipe's end is non-blocking meanwhile and the loop waits until it can take more. The length and the bytes
        go out together (`os.writev`), never joined: a copy of a 500 KB history was 0.4 ms of the event loop's."""
        if len(payload) >= 0x7FFFFFFF:
            raise ValueError("a worker call of 2 GiB or more")
        loop, fd = asyncio.get_running_loop(), self._conn.fileno()
        parts = [memoryview(struct.pack("!i", len(payload))), memoryview(payload).cast("B")]
        os.set_blocking(fd, False)
        try:
            while parts:
                try:
                    _drop_written(parts, os.writev(fd, parts))
                except BlockingIOError:
                    writable: asyncio.Future[None] = loop.create_future()
                    loop.add_writer(fd, _set_once, writable)
                    try:
                        await writable
                    finally:
                        loop.remove_writer(fd)
        finally:
            if not self.closed:
                os.set_blocking(fd, True)

    async def _answer(self) -> Any:
        """The child's next message, read when the pipe says it is there."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[tuple[bool, Any]] = loop.create_future()
        fd = self._conn.fileno()

        def readable() -> None:
            loop.remove_reader(fd)
            if answer.done():
                return
            try:
                answer.set_result(self._conn.recv())
            except (EOFError, OSError) as exc:
                answer.set_exception(WorkerDied(f"the worker process is gone ({exc!r})"))
            except Exception as exc:  # an answer that cannot be read: the pipe is out of step from here on
                answer.set_exception(WorkerDied(f"the worker process's answer could not be read ({exc!r})"))

        loop.add_reader(fd, readable)
        try:
            ok, value = await answer
        except (asyncio.CancelledError, WorkerDied):
            self.close()
            raise
        finally:
            if not self.closed:
                loop.remove_reader(fd)
        if not ok:
            if not self._ready:  # its initializer failed: the child has exited
                self.close()
            raise WorkerFailed(value)
        return value

    def close(self) -> None:
        """Stop the child without waiting for it: the pipe closes (an idle child exits on EOF) and a busy one is
        terminated. Nothing blocks the event loop here; multiprocessing reaps the process."""
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(OSError, ValueError, RuntimeError):  # RuntimeError: no event loop running
            asyncio.get_running_loop().remove_reader(self._conn.fileno())
        self._conn.close()
        if self._process.is_alive():
            self._process.terminate()


def _drop_written(parts: list[memoryview], sent: int) -> None:
    """Take `sent` bytes off the front of `parts` (what one `os.writev` wrote)."""
    while parts and sent >= len(parts[0]):
        sent -= len(parts.pop(0))
    if sent:
        parts[0] = parts[0][sent:]


def _set_once(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
