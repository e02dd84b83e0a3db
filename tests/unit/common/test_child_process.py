"""The statistics worker process: calls over a pipe the event loop watches, no thread in the proxy's process."""

from __future__ import annotations

import asyncio
import os
import signal
import threading

import pytest

from adaptive_spec.common.child_process import WorkerDied, WorkerFailed, WorkerProcess

_STATE: dict[str, int] = {}


def _init(start: int) -> None:
    _STATE["n"] = start


def _add(k: int, blob: bytes) -> tuple[int, int]:
    _STATE["n"] += k
    return _STATE["n"], len(blob)


def _fail() -> None:
    raise ValueError("no such session")


def _pid() -> int:
    return os.getpid()


def _bad_init() -> None:
    raise RuntimeError("cannot load the vocabulary")


@pytest.mark.asyncio
async def test_calls_run_in_the_child_one_at_a_time_and_start_no_thread_here() -> None:
    threads = threading.active_count()
    worker = WorkerProcess(_init, (10,))
    try:
        big = os.urandom(3 * 1024 * 1024)  # far more than a pipe holds: written while the child reads
        results = await asyncio.gather(*(worker.call(_add, k, big) for k in (1, 2, 3)))
        assert sorted(results) == [(11, len(big)), (13, len(big)), (16, len(big))]  # one after the other
        with pytest.raises(WorkerFailed, match="ValueError: no such session"):
            await worker.call(_fail)
        assert await worker.call(_add, 0, b"") == (16, 0)  # the process lives on, its state with it
        assert await worker.call(_pid) != os.getpid()
        assert threading.active_count() == threads
    finally:
        worker.close()


@pytest.mark.asyncio
async def test_a_child_that_dies_or_cannot_start_is_told_apart() -> None:
    worker = WorkerProcess(_init, (0,))
    pid = await worker.call(_pid)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerDied):
        await worker.call(_add, 1, b"")
    assert worker.closed
    broken = WorkerProcess(_bad_init)
    with pytest.raises(WorkerFailed, match="cannot load the vocabulary"):
        await broken.call(_pid)
    assert broken.closed
    with pytest.raises(WorkerDied):
        await broken.call(_pid)


def _nice() -> int:
    return os.nice(0)


def _slow_add(k: int, blob: bytes) -> tuple[int, int]:
    import time

    time.sleep(0.3)
    return _add(k, blob)


@pytest.mark.asyncio
async def test_the_child_runs_at_a_lower_priority_and_a_large_call_does_not_block_the_loop() -> None:
    """A call larger than the pipe holds is written as the child reads it: while the child is busy and not reading
    (here still in a slow call), the event loop goes on (a blocking write would stall every stream for that long)."""
    from multiprocessing.reduction import ForkingPickler

    worker = WorkerProcess(_init, (0,), niceness=5)
    try:
        assert await worker.call(_nice) == os.nice(0) + 5
        first = asyncio.ensure_future(worker.call(_slow_add, 1, b""))  # the child is busy for 0.3 s
        await asyncio.sleep(0.05)
        big = os.urandom(4 * 1024 * 1024)
        sending = asyncio.ensure_future(worker._send_large(ForkingPickler.dumps((_add, (2, big)))))
        ticks, deadline = 0, asyncio.get_running_loop().time() + 30
        while not sending.done():
            assert asyncio.get_running_loop().time() < deadline, "the large call was not written within 30 s"
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks >= 10  # the loop ran while the child was not reading (a blocking write: none)
        assert await first == (1, 0)
        assert await worker._answer() == (3, len(big))  # the large call, read whole by the child
    finally:
        worker.close()
