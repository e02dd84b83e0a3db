"""Sessions for the proxy: grouping each request, and updating the repeated-context statistics after each response in
one background task (tokenizing off the request path, in arrival order).

The updates' own work (digests, indexing, the drafter's replay: pure Python that grows with the history) runs in a
statistics backend (`sessions/backends.py`): a child process that holds the tracker (`worker_process=True`, what `serve`
uses), or a thread (see docs/architecture.md, "Per-request cost")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from typing import Any

from adaptive_spec.common.lru import LRU
from adaptive_spec.sessions.backends import ProcessStatistics, StatisticsBackend, ThreadStatistics, Work
from adaptive_spec.sessions.grouping import ECHO_FINGERPRINTS, SessionAssignment, SessionRegistry
from adaptive_spec.sessions.project import resolve_project
from adaptive_spec.sessions.statistics import ContextTracker, SessionSnapshot
from adaptive_spec.sessions.tokenizers import Tokenizer
from adaptive_spec.streams.output import OutputCollector
from adaptive_spec.telemetry.events import Event, SessionUpdated

log = logging.getLogger(__name__)
ESTIMATE_NOTE = (
    "est_* figures are estimates: a replay of each response through a simulated ngram-mod drafter over the "
    "session's context, whichever profile served it"
)


class SessionService:
    def __init__(
        self,
        tracker: ContextTracker,
        tokenizer: Tokenizer | None,
        key_projects: Mapping[str, str] | None = None,
        queue_size: int = 4096,
        publish: Callable[[Event], None] = lambda _event: None,
        queue_bytes: int = 64 * 1024 * 1024,
        worker_process: bool = False,
        max_fingerprints: int = ECHO_FINGERPRINTS,
        run: str = "",
    ) -> None:
        self.registry = SessionRegistry(max_fingerprints, run=run)
        self.tracker = tracker
        self.tokenizer = tokenizer
        self._key_projects = dict(key_projects or {})
        self._projects: LRU[str, str] = LRU(10_000)  # session -> project
        # Updates waiting for the worker: at most one per session (and kind: main line or side), the newest. A newer
        # turn's body holds the older one's history and reply, so it indexes all of it; only the older turn's own
        # replay is skipped (counted as coalesced). Bounded by sessions waiting and by their bodies' bytes.
        self._waiting: dict[tuple[str, bool], Work] = {}
        self._ready: asyncio.Queue[tuple[str, bool]] = asyncio.Queue()
        self._waiting_bytes = 0
        self.queue_size, self.queue_bytes = queue_size, queue_bytes
        self.dropped = 0
        self.coalesced = 0
        self.processed = 0
        self._pending: dict[str, int] = {}  # session -> updates waiting or running
        self._settled: dict[str, asyncio.Event] = {}
        self.publish = publish
        # With a child process, `tracker` is the empty template it starts from; the proxy reads the sessions'
        # latest snapshots, which each update brings back.
        self.worker_process = worker_process
        self.backend: StatisticsBackend = (
            ProcessStatistics(tracker, tokenizer) if worker_process else ThreadStatistics(tracker)
        )

    def assign(
        self,
        headers: Mapping[str, str],
        body: Mapping[str, Any],
        path_project: str | None,
        workspace_path: str | None,
    ) -> tuple[SessionAssignment, str]:
        """The request's session and project. `headers` must have lower-case keys; `workspace_path` is what
        `workspace_path_from_request` found (read once per request by the caller)."""
        assignment = self.registry.assign(headers, body)
        auth = headers.get("authorization", "")
        api_key = auth[7:] if auth.lower().startswith("bearer ") else headers.get("x-api-key")
        api_key = api_key or headers.get("x-goog-api-key")  # Gemini's (its `?key=` comes as this header)
        project, _ = resolve_project(
            path_project,
            api_key,
            self._key_projects,
            headers,
            body,
            self._projects.get(assignment.session_id),
            workspace_path=workspace_path,
        )
        self._projects.put(assignment.session_id, project)
        return assignment, project

    def unanswered(self, assignment: SessionAssignment, body: Mapping[str, Any]) -> None:
        """A request ended with nothing served: a conversation's first one may be sent again (`note_unanswered`)."""
        self.registry.note_unanswered(assignment, body)

    def finished(
        self,
        assignment: SessionAssignment,
        project: str,
        body: Mapping[str, Any],
        out: OutputCollector,
        request_id: str = "",
        *,
        side: bool = False,
        line_moved: bool = False,
        body_bytes: int = 0,
        raw_body: bytes = b"",
    ) -> None:
        """A response was served in full: remember it for the reply echo now; update statistics in the background.
        `raw_body`: the client's bytes of `body`, when at hand."""
        text = out.text
        sid = assignment.session_id
        self.registry.note_reply(sid, text, out.tool_call_ids)
        if self.tokenizer is None:
            return
        key = (sid, side)
        older = self._waiting.get(key)
        freed = older.body_bytes if older is not None else 0
        if (older is None and len(self._waiting) >= self.queue_size) or (
            self._waiting_bytes - freed + body_bytes > self.queue_bytes and self._waiting
        ):
            self.dropped += 1
            return
        work = Work(
            request_id, sid, project, body, text, time.time(), side, line_moved, body_bytes, raw_body,
            output_calls=out.calls > 0,
        )  # fmt: skip
        self._waiting_bytes += body_bytes - freed
        if older is not None:
            self.coalesced += 1
            self._waiting[key] = replace(work, line_moved=line_moved or older.line_moved, turns=older.turns + 1)
            return
        self._waiting[key] = work
        self._ready.put_nowait(key)
        self._pending[sid] = self._pending.get(sid, 0) + 1
        self._settled.setdefault(sid, asyncio.Event()).clear()

    def _done(self, session_id: str) -> None:
        left = self._pending.get(session_id, 1) - 1
        if left > 0:
            self._pending[session_id] = left
            return
        self._pending.pop(session_id, None)
        event = self._settled.pop(session_id, None)
        if event is not None:
            event.set()

    async def settled(self, session_id: str, timeout: float) -> bool:  # noqa: ASYNC109 - a short bounded wait
        """Wait (at most `timeout` s) until the session's previous turns are folded into its statistics, so a
        client that sends its next turn at once is routed on them. True when nothing is pending any more."""
        event = self._settled.get(session_id)
        if event is None:
            return True
        try:
            async with asyncio.timeout(timeout):  # not wait_for: on Python 3.11 it can lose a cancel
                await event.wait()
        except TimeoutError:
            return False
        return True

    def known(self, session_id: str) -> bool:
        """Whether a request was grouped into this session (and it has not been forgotten since)."""
        return self._projects.get(session_id) is not None

    def copy_state(self, session_id: str) -> tuple[int, float | None]:
        """(turns with statistics, estimated n-gram accepted share EWMA) of a session, for routing."""
        return self.backend.copy_state(session_id)

    async def run(self, expire_every_s: float = 60.0) -> None:
        """The worker: one update at a time, so a session's turns are folded in the order they were served; idle
        sessions are dropped at least every `expire_every_s`, traffic or not."""
        try:
            with contextlib.suppress(Exception):  # said where it happened; the first update tries again
                await self.backend.start()
            while True:
                try:
                    # Not asyncio.wait_for: on Python 3.11 it returns the item when the get completes in the same
                    # loop turn as a cancel, and the cancel is lost (the shutdown then waits on this task forever).
                    async with asyncio.timeout(expire_every_s):
                        key = await self._ready.get()
                except TimeoutError:
                    await self.backend.expire_idle()
                    continue
                work = self._waiting.pop(key)
                self._waiting_bytes -= work.body_bytes
                try:
                    await self._update(work)
                    self.processed += 1
                except Exception:
                    log.exception("session statistics update failed for %s", work.session_id)
                finally:
                    self._done(work.session_id)
                    self._ready.task_done()
                self.backend.expire()
        finally:
            self.backend.close()

    def update_counts(self) -> dict[str, int]:
        """Statistics updates by outcome, for /metrics."""
        return {"processed": self.processed, "coalesced": self.coalesced, "dropped": self.dropped}

    def expire(self) -> None:
        """Drop idle sessions from what the proxy reads (before `/adaptive/sessions` lists them)."""
        self.backend.expire()

    def snapshots(self) -> list[SessionSnapshot]:
        return self.backend.snapshots()

    async def drain(self) -> None:
        """Wait until every queued update is folded in (tests and shutdown)."""
        await self._ready.join()

    async def _update(self, work: Work) -> None:
        assert self.tokenizer is not None
        turn, snap = await self.backend.update(work, self.tokenizer)
        self.publish(
            SessionUpdated(
                session_id=work.session_id,
                project=work.project,
                turn=asdict(turn),
                est_accepted_share_ewma=snap.est_accepted_share_ewma if snap else None,
                request_id=work.request_id or None,
            )
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "note": ESTIMATE_NOTE,
            "tokenizer": self.tokenizer.name if self.tokenizer is not None else None,
            "ngram": asdict(self.tracker.params),
            "updates_processed": self.processed,
            "updates_coalesced": self.coalesced,
            "updates_dropped": self.dropped,
            # Updates sent to the child process as only the messages after those it folded last; of those, the
            # ones it asked for the whole body after all.
            **self.backend.counts(),
            "sessions": [asdict(s) for s in self.snapshots()],
        }


async def run_worker(service: SessionService) -> None:
    with contextlib.suppress(asyncio.CancelledError):
        await service.run()
