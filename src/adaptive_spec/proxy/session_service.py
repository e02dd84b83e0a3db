"""Sessions for the proxy: grouping each request, and updating the repeated-context statistics after each
response in one background worker (tokenizing off the request path, in arrival order)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from adaptive_spec.core.events import Event, SessionUpdated
from adaptive_spec.core.lru import LRU
from adaptive_spec.core.output import OutputCollector
from adaptive_spec.core.sessions.grouping import SessionAssignment, SessionRegistry, context_messages, message_digest
from adaptive_spec.core.sessions.project import resolve_project
from adaptive_spec.core.sessions.statistics import ContextTracker, SessionSnapshot, TurnStats
from adaptive_spec.proxy.tokenizers import Tokenizer

log = logging.getLogger(__name__)
ESTIMATE_NOTE = (
    "est_* figures are estimates: a replay of each response through a simulated ngram-mod drafter over the "
    "session's context, whichever profile served it"
)


@dataclass(frozen=True, slots=True)
class _Work:
    request_id: str
    session_id: str
    project: str
    body: Mapping[str, Any]
    output_text: str
    at: float
    side: bool = False
    line_moved: bool = False
    body_bytes: int = 0


class SessionService:
    def __init__(
        self,
        tracker: ContextTracker,
        tokenizer: Tokenizer | None,
        key_projects: Mapping[str, str] | None = None,
        queue_size: int = 4096,
        publish: Callable[[Event], None] = lambda _event: None,
        queue_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        self.registry = SessionRegistry()
        self.tracker = tracker
        self.tokenizer = tokenizer
        self._key_projects = dict(key_projects or {})
        self._projects: LRU[str, str] = LRU(10_000)  # session -> project
        # Updates waiting for the worker: at most one per session (and kind: main line or side), the newest. A newer
        # turn's body holds the older one's history and reply, so it indexes all of it; only the older turn's own
        # replay is skipped (counted as coalesced). Bounded by sessions waiting and by their bodies' bytes.
        self._waiting: dict[tuple[str, bool], _Work] = {}
        self._ready: asyncio.Queue[tuple[str, bool]] = asyncio.Queue()
        self._waiting_bytes = 0
        self.queue_size, self.queue_bytes = queue_size, queue_bytes
        self._lock = threading.Lock()  # the tracker is updated in a worker thread and read on the event loop
        self.dropped = 0
        self.coalesced = 0
        self.processed = 0
        self._pending: dict[str, int] = {}  # session -> updates waiting or running
        self._settled: dict[str, asyncio.Event] = {}
        self.publish = publish

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
    ) -> None:
        """A response was served in full: remember it for the reply echo now; update statistics in the background."""
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
        work = _Work(request_id, sid, project, body, text, time.time(), side, line_moved, body_bytes)
        self._waiting_bytes += body_bytes - freed
        if older is not None:
            self.coalesced += 1
            self._waiting[key] = replace(work, line_moved=line_moved or older.line_moved)
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
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def known(self, session_id: str) -> bool:
        """Whether a request was grouped into this session (and it has not been forgotten since)."""
        return self._projects.get(session_id) is not None

    def copy_state(self, session_id: str) -> tuple[int, float | None]:
        """(turns with statistics, estimated n-gram accepted share EWMA) of a session, for routing."""
        # No lock: a fold of a long turn holds it for tens of milliseconds and this runs on the event loop. Two
        # attribute reads of one session are atomic enough under the GIL; at worst they are one turn old.
        return self.tracker.copy_state(session_id)

    async def run(self, expire_every_s: float = 60.0) -> None:
        """The worker: one update at a time, so a session's turns are folded in the order they were served; idle
        sessions are dropped at least every `expire_every_s`, traffic or not."""
        while True:
            try:
                key = await asyncio.wait_for(self._ready.get(), expire_every_s)
            except TimeoutError:
                self.expire()
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
            self.expire()

    def update_counts(self) -> dict[str, int]:
        """Statistics updates by outcome, for /metrics."""
        return {"processed": self.processed, "coalesced": self.coalesced, "dropped": self.dropped}

    def expire(self) -> None:
        with self._lock:
            self.tracker.expire(time.time())

    def snapshots(self) -> list[SessionSnapshot]:
        with self._lock:
            return self.tracker.snapshots()

    async def drain(self) -> None:
        """Wait until every queued update is folded in (tests and shutdown)."""
        await self._ready.join()

    async def _update(self, work: _Work) -> None:
        """Everything proportional to the history (digests, the plan, indexing, the replay) runs in a worker thread;
        the event loop only hands the new texts to the tokenizer."""
        assert self.tokenizer is not None

        def prepare() -> tuple[list[tuple[bytes, bool, str]], list[int]]:
            messages = context_messages(work.body)
            with self._lock:
                return messages, self.tracker.plan(work.session_id, [(d, assistant) for d, assistant, _ in messages])

        messages, plan = await asyncio.to_thread(prepare)
        texts = [messages[i][2] for i in plan] + [work.output_text]
        tokens = await self.tokenizer.encode(texts)
        all_digests = [digest for digest, _, _ in messages]

        def fold() -> tuple[TurnStats, SessionSnapshot | None]:
            # Indexing a long first turn takes tens of milliseconds of pure Python: off the event loop.
            reply_digest = message_digest("assistant", work.output_text)
            with self._lock:
                if work.line_moved:
                    self.tracker.demote(work.session_id)
                self.tracker.on_prompt(work.session_id, work.project, all_digests, tokens[:-1], work.at)
                turn = self.tracker.on_output(
                    work.session_id, work.project, reply_digest, tokens[-1], work.at, side=work.side
                )
                return turn, self.tracker.snapshot(work.session_id)

        turn, snap = await asyncio.to_thread(fold)
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
            "sessions": [asdict(s) for s in self.snapshots()],
        }


async def run_worker(service: SessionService) -> None:
    with contextlib.suppress(asyncio.CancelledError):
        await service.run()
