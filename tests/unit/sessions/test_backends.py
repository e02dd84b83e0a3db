"""The statistics worker stops when cancelled, even when the cancel lands in the loop turn its queue get completes
(Python 3.11's asyncio.wait_for returned the item then and lost the cancel: `serve` never finished its shutdown)."""

import asyncio
import contextlib

from adaptive_spec.sessions.backends import Work
from adaptive_spec.sessions.ngram_replay import NgramParams
from adaptive_spec.sessions.service import SessionService, run_worker
from adaptive_spec.sessions.statistics import ContextTracker


def test_worker_stops_when_cancelled_as_it_takes_an_update() -> None:
    async def main() -> bool:
        service = SessionService(ContextTracker(NgramParams()), None)
        taken: list[str] = []

        async def update(work: Work) -> None:
            taken.append(work.session_id)
            await asyncio.sleep(0)

        service._update = update  # type: ignore[method-assign]
        worker: list[asyncio.Task[None]] = []

        class CancelOnGet(asyncio.Queue[tuple[str, bool]]):
            def get_nowait(self) -> tuple[str, bool]:
                item = super().get_nowait()
                if worker and not worker[0].cancelling():
                    worker[0].cancel()  # what the app's cleanup does, in the very loop turn the get completes
                return item

        service._ready = CancelOnGet()
        for i in range(3):
            key = (f"s{i}", False)
            service._waiting[key] = Work(f"r{i}", key[0], "p", {}, "", 0.0)
            service._ready.put_nowait(key)
        task = asyncio.create_task(run_worker(service))
        worker.append(task)
        done, _ = await asyncio.wait({task}, timeout=2.0)
        if not done:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return bool(done)

    assert asyncio.run(main()), "the statistics worker swallowed its cancel and kept running"
