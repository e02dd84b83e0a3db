"""Sessions for the proxy: grouping each request, and updating the repeated-context statistics after each
response in one background worker (tokenizing off the request path, in arrival order). The updates' own work (digests,
indexing, the drafter's replay: pure Python that grows with the history) runs in a worker process that holds the
tracker (`worker_process=True`, what `serve` uses), or in a thread: a thread holds the GIL while it works, and the
streams' chunks wait for it (see docs/architecture.md, "Per-request cost")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import orjson

from adaptive_spec.common.lru import LRU
from adaptive_spec.sessions import updates
from adaptive_spec.sessions import worker as session_worker
from adaptive_spec.sessions.grouping import (
    ECHO_FINGERPRINTS,
    SessionAssignment,
    SessionRegistry,
    messages_of,
    same_start,
)
from adaptive_spec.sessions.project import resolve_project
from adaptive_spec.sessions.statistics import ContextTracker, SessionSnapshot, TurnStats
from adaptive_spec.sessions.tokenizers import Tokenizer, tokenizer_spec
from adaptive_spec.sessions.worker_process import WorkerDied, WorkerFailed, WorkerProcess
from adaptive_spec.streams.output import OutputCollector
from adaptive_spec.telemetry.events import Event, SessionUpdated

log = logging.getLogger(__name__)
_MIRROR_EXPIRY_EVERY_S = 5.0  # idle sessions' snapshots are dropped at most this often (their expiry is minutes)
ESTIMATE_NOTE = (
    "est_* figures are estimates: a replay of each response through a simulated ngram-mod drafter over the "
    "session's context, whichever profile served it"
)


# The requests last folded in the worker process that are kept, to send a session's next turn only what follows
# them: by sessions, and by the bytes of their bodies (their messages are mostly the router's, kept as seen).
_SENT_SESSIONS = 4096
_SENT_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class _Sent:
    """A session's request last folded in the worker process: its id, and its messages as parsed."""

    request_id: str
    messages: list[Any]
    weight: int


# What the worker process answers an update: the turn's statistics, the session's snapshot, the sessions it dropped.
_Folded = tuple[TurnStats, SessionSnapshot | None, list[str]]


# The statistics worker runs at a lower CPU priority than the proxy (nice 10: about a tenth of a core's share when
# the proxy, the client or llama-server want the cores; all of a free one): its updates may wait, the streams not.
WORKER_NICENESS = 10


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
    raw: bytes = b""  # the client's bytes of `body` (what the worker process is sent, rather than `body` pickled)
    turns: int = 1  # the session's turns it stands for (the later of two waiting updates replaces the earlier)
    output_calls: bool = False  # the reply is tool calls


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
    ) -> None:
        self.registry = SessionRegistry(max_fingerprints)
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
        # With a worker process, `tracker` is the empty template it starts from; the proxy reads the sessions'
        # latest snapshots, which each update brings back.
        self.worker_process = worker_process
        self._process: WorkerProcess | None = None
        self._mirror: LRU[str, SessionSnapshot] = LRU(tracker.max_sessions)
        self._mirror_expired_at = 0.0
        # The worker process tokenizes too when the tokenizer can be made again there (one round trip an update).
        self._spec = tokenizer_spec(tokenizer) if worker_process else None
        self._sent: LRU[str, _Sent] = LRU(_SENT_SESSIONS, max_weight=_SENT_BYTES, weigh=lambda sent: sent.weight)
        self.sent_new_only = 0  # updates sent only their new messages
        self.sent_again = 0  # ... of which the worker asked for the whole body after all

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
        work = _Work(
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
        if self.worker_process:
            snap = self._mirror.get(session_id)
            return (snap.turns, snap.est_accepted_share_ewma) if snap is not None else (0, None)
        # No lock: a fold of a long turn holds it for tens of milliseconds and this runs on the event loop. Two
        # attribute reads of one session are atomic enough under the GIL; at worst they are one turn old.
        return self.tracker.copy_state(session_id)

    async def run(self, expire_every_s: float = 60.0) -> None:
        """The worker: one update at a time, so a session's turns are folded in the order they were served; idle
        sessions are dropped at least every `expire_every_s`, traffic or not."""
        try:
            if self.worker_process:
                # Start the process now, not on the first update: spawning it and importing takes a second or more,
                # and the turns served meanwhile would wait (and coalesce) behind the first.
                with contextlib.suppress(Exception):
                    await self._in_process(updates.process_expire, time.time())
            while True:
                try:
                    # Not asyncio.wait_for: on Python 3.11 it returns the item when the get completes in the same
                    # loop turn as a cancel, and the cancel is lost (the shutdown then waits on this task forever).
                    async with asyncio.timeout(expire_every_s):
                        key = await self._ready.get()
                except TimeoutError:
                    await self._expire_worker()
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
                self.expire()  # the worker process expired its own sessions with the update
        finally:
            if self._process is not None:
                self._process.close()
                self._process = None

    def update_counts(self) -> dict[str, int]:
        """Statistics updates by outcome, for /metrics."""
        return {"processed": self.processed, "coalesced": self.coalesced, "dropped": self.dropped}

    def expire(self) -> None:
        if self.worker_process:  # the process expires its own sessions after each update
            idle = self.tracker.idle_expiry_s
            now = time.time()
            if now - self._mirror_expired_at < _MIRROR_EXPIRY_EVERY_S:
                return  # a look at every session, after every update, was a scan per request
            self._mirror_expired_at = now
            for sid, snap in self._mirror.items():
                if now - snap.last_seen > idle:
                    self._mirror.pop(sid)
            return
        with self._lock:
            self.tracker.expire(time.time())

    async def _expire_worker(self) -> None:
        if self.worker_process and self._process is not None:
            for sid in await self._in_process(updates.process_expire, time.time()):
                self._mirror.pop(sid)
        self.expire()

    def snapshots(self) -> list[SessionSnapshot]:
        if self.worker_process:
            return [snap for sid in reversed(self._mirror) if (snap := self._mirror.get(sid)) is not None]
        with self._lock:
            return self.tracker.snapshots()

    async def drain(self) -> None:
        """Wait until every queued update is folded in (tests and shutdown)."""
        await self._ready.join()

    async def _in_process(self, func: Callable[..., Any], *args: Any) -> Any:
        """`func(*args)` in the worker process (started on first use; started again if it died: its statistics are
        lost, the proxy's requests are not). A worker that cannot make the tokenizer again goes on without it: the
        event loop tokenizes."""
        if self._process is None:
            settings = updates.tracker_settings(self.tracker)
            if self._spec is not None:
                self._process = WorkerProcess(session_worker.init, (settings, self._spec), niceness=WORKER_NICENESS)
            else:
                self._process = WorkerProcess(updates.process_init, (settings,), niceness=WORKER_NICENESS)
        process = self._process
        try:
            return await process.call(func, *args)
        except WorkerFailed as exc:
            if not process.closed:
                raise  # the function failed; the process lives on
            log.warning("the session statistics worker could not start (%s); tokenizing on the event loop", exc)
            self._process, self._spec = None, None
            raise
        except WorkerDied:
            log.warning("the session statistics worker process died; starting another (statistics start over)")
            self._process = None
            self._mirror = LRU(self.tracker.max_sessions)
            self._sent = LRU(_SENT_SESSIONS, max_weight=_SENT_BYTES, weigh=lambda sent: sent.weight)
            raise

    async def _update(self, work: _Work) -> None:
        """The history-sized work (digests, the plan, indexing, the replay) runs in the worker process or a thread;
        the tokenizing too in the worker process when its tokenizer can be made there (else the event loop picks
        the new texts and hands them to the proxy's tokenizer)."""
        assert self.tokenizer is not None
        if self._spec is not None and work.raw:
            messages = messages_of(work.body)

            def fold(raw: bytes, after: tuple[str, int] | None = None) -> Awaitable[_Folded | None]:
                return self._in_process(
                    session_worker.update, work.session_id, work.project, raw, work.output_text, work.at, work.side,
                    work.line_moved, time.time(), work.turns, work.output_calls, work.request_id, after,
                )  # fmt: skip

            result: _Folded | None = None
            rest = self._rest(work, messages)
            if rest is not None:
                after, raw_rest = rest
                self.sent_new_only += 1
                result = await fold(raw_rest, after)
                self.sent_again += result is None
            if result is None:
                result = await fold(work.raw)
            assert result is not None  # the whole body is always folded
            if self._mirror.get(work.session_id) is not None:
                # Kept from a session's second update on: a conversation of one request (a retry, a new one without
                # an id) would only hold its parsed body in memory.
                self._sent.put(work.session_id, _Sent(work.request_id, messages, len(work.raw)))
            self._after_update(work, *result)
            return
        digests: list[bytes] | None = None
        if self.worker_process:
            plan = await self._in_process(updates.process_plan, work.session_id, work.body)
        else:
            plan, digests = await asyncio.to_thread(self._locked, updates.plan_update, work.session_id, work.body)
        planned = updates.planned_texts(work.body, plan)
        tokens = await self.tokenizer.encode([*(text for _, text in planned), work.output_text])
        job = updates.FoldJob(
            work.session_id, work.project, tokens[:-1], work.output_text, tokens[-1], work.at, work.side,
            work.line_moved, digests, work.turns, [role for role, _ in planned], work.output_calls,
        )  # fmt: skip
        gone: list[str] = []
        if self.worker_process:
            turn, snap, gone = await self._in_process(updates.process_fold_expire, job, time.time())
        else:
            turn, snap = await asyncio.to_thread(self._locked, updates.fold_update, job, digests or [])
        self._after_update(work, turn, snap, gone)

    def _rest(self, work: _Work, messages: list[Any]) -> tuple[tuple[str, int], bytes] | None:
        """((the request last folded, how many of its first messages this one repeats), this one's body without
        them) for a turn that repeats some; None: the whole body goes. Compared as parsed values, in C (a memcmp
        of each text); the rest is made of the system prompt kept apart and the messages that follow."""
        sent = self._sent.get(work.session_id)
        if sent is None or not work.request_id or not sent.request_id:
            return None
        same = same_start(messages, sent.messages)
        if same == 0:
            return None
        body = work.body
        rest: dict[str, Any] = {key: body[key] for key in ("instructions", "system") if key in body}
        rest["messages" if body.get("messages") is not None else "input"] = messages[same:]
        return (sent.request_id, same), orjson.dumps(rest)

    def _after_update(self, work: _Work, turn: TurnStats, snap: SessionSnapshot | None, gone: list[str]) -> None:
        if self.worker_process:
            for sid in gone:
                self._mirror.pop(sid)
                self._sent.pop(sid)
            if snap is not None:
                self._mirror.put(work.session_id, snap)
        self.publish(
            SessionUpdated(
                session_id=work.session_id,
                project=work.project,
                turn=asdict(turn),
                est_accepted_share_ewma=snap.est_accepted_share_ewma if snap else None,
                request_id=work.request_id or None,
            )
        )

    def _locked(self, func: Callable[..., Any], *args: Any) -> Any:
        with self._lock:
            return func(self.tracker, *args)

    def to_json(self) -> dict[str, Any]:
        return {
            "note": ESTIMATE_NOTE,
            "tokenizer": self.tokenizer.name if self.tokenizer is not None else None,
            "ngram": asdict(self.tracker.params),
            "updates_processed": self.processed,
            "updates_coalesced": self.coalesced,
            "updates_dropped": self.dropped,
            # Updates sent to the worker process as only the messages after those it folded last; of those, the
            # ones it asked for the whole body after all.
            "updates_sent_new_only": self.sent_new_only,
            "updates_sent_again": self.sent_again,
            "sessions": [asdict(s) for s in self.snapshots()],
        }


async def run_worker(service: SessionService) -> None:
    with contextlib.suppress(asyncio.CancelledError):
        await service.run()
