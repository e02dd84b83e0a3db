"""Where a session-statistics update's history-sized work runs (digests, the pick, indexing, the drafter's replay): one
interface, `StatisticsBackend`, with two implementations.

`ProcessStatistics` (what `serve` uses) holds the tracker in a child process and keeps the sessions' latest snapshots
here; `ThreadStatistics` holds it here, behind a lock, and works in a thread, which holds the GIL while it works, so the
streams' chunks wait for it."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from adaptive_spec.common.child_process import WorkerDied, WorkerFailed, WorkerProcess
from adaptive_spec.common.lru import LRU
from adaptive_spec.sessions import stats_child as session_worker
from adaptive_spec.sessions import updates
from adaptive_spec.sessions.messages import messages_of, same_start
from adaptive_spec.sessions.statistics import ContextTracker, SessionSnapshot, TurnStats
from adaptive_spec.sessions.tokenizers import Tokenizer, tokenizer_spec

log = logging.getLogger(__name__)
_MIRROR_EXPIRY_EVERY_S = 5.0  # idle sessions' snapshots are dropped at most this often (their expiry is minutes)
# The requests last folded in the child process that are kept, to send a session's next turn only what follows
# them: by sessions, and by the bytes of their bodies (their messages are mostly the router's, kept as seen).
_SENT_SESSIONS = 4096
_SENT_BYTES = 64 * 1024 * 1024
# The child runs at a lower CPU priority than the proxy (nice 10: about a tenth of a core's share when the proxy,
# the client or llama-server want the cores; all of a free one): its updates may wait, the streams not.
WORKER_NICENESS = 10


@dataclass(frozen=True, slots=True)
class Work:
    """One served turn to fold into its session's statistics."""

    request_id: str
    session_id: str
    project: str
    body: Any  # the client's parsed body
    output_text: str
    at: float
    side: bool = False
    line_moved: bool = False
    body_bytes: int = 0
    raw: bytes = b""  # the client's bytes of `body` (what the child process is sent, rather than `body` pickled)
    turns: int = 1  # the session's turns it stands for (the later of two waiting updates replaces the earlier)
    output_calls: bool = False  # the reply is tool calls


Folded = tuple[TurnStats, SessionSnapshot | None]


class StatisticsBackend(Protocol):
    def copy_state(self, session_id: str) -> tuple[int, float | None]:
        """(turns with statistics, estimated n-gram accepted share EWMA) of a session: read on the event loop."""
        ...

    def snapshots(self) -> list[SessionSnapshot]: ...

    def expire(self) -> None:
        """Drop idle sessions of what is read here (cheap: after every update)."""
        ...

    async def expire_idle(self) -> None:
        """Drop idle sessions everywhere (when no update came for a while)."""
        ...

    async def start(self) -> None: ...

    async def update(self, work: Work, tokenizer: Tokenizer) -> Folded: ...

    def close(self) -> None: ...

    def counts(self) -> dict[str, int]:
        """What /adaptive/sessions says of how updates were sent."""
        ...


class ThreadStatistics:
    """The tracker in this process, updated in a worker thread and read on the event loop."""

    def __init__(self, tracker: ContextTracker) -> None:
        self.tracker = tracker
        self._lock = threading.Lock()

    def copy_state(self, session_id: str) -> tuple[int, float | None]:
        # No lock: a fold of a long turn holds it for tens of milliseconds and this runs on the event loop. Two
        # attribute reads of one session are atomic enough under the GIL; at worst they are one turn old.
        return self.tracker.copy_state(session_id)

    def snapshots(self) -> list[SessionSnapshot]:
        with self._lock:
            return self.tracker.snapshots()

    def expire(self) -> None:
        with self._lock:
            self.tracker.expire(time.time())

    async def expire_idle(self) -> None:
        self.expire()

    async def start(self) -> None:
        return None

    async def update(self, work: Work, tokenizer: Tokenizer) -> Folded:
        pick, digests = await asyncio.to_thread(self._locked, updates.pick_update, work.session_id, work.body)
        job = await _fold_job(work, pick, digests, tokenizer)
        folded: Folded = await asyncio.to_thread(self._locked, updates.fold_update, job, digests or [])
        return folded

    def close(self) -> None:
        return None

    def counts(self) -> dict[str, int]:
        return {"updates_sent_new_only": 0, "updates_sent_again": 0}

    def _locked(self, func: Callable[..., Any], *args: Any) -> Any:
        with self._lock:
            return func(self.tracker, *args)


@dataclass(frozen=True, slots=True)
class _Sent:
    """A session's request last folded in the child process: its id, and its messages as parsed."""

    request_id: str
    messages: list[Any]
    weight: int


class ProcessStatistics:
    """The tracker in a child process (started with the service, started again if it dies: its statistics are lost,
    the proxy's requests are not); the sessions' latest snapshots, which each update brings back, kept here. The
    child tokenizes too when the tokenizer can be made again there (one round trip an update)."""

    def __init__(self, template: ContextTracker, tokenizer: Tokenizer | None) -> None:
        self.template = template  # the empty tracker the child starts from
        self.spec = tokenizer_spec(tokenizer) if tokenizer is not None else None
        self._process: WorkerProcess | None = None
        self._mirror: LRU[str, SessionSnapshot] = LRU(template.max_sessions)
        self._mirror_expired_at = 0.0
        self._sent: LRU[str, _Sent] = LRU(_SENT_SESSIONS, max_weight=_SENT_BYTES, weigh=lambda sent: sent.weight)
        self.sent_new_only = 0  # updates sent only their new messages
        self.sent_again = 0  # ... of which the child asked for the whole body after all

    @property
    def started(self) -> bool:
        return self._process is not None

    def copy_state(self, session_id: str) -> tuple[int, float | None]:
        snap = self._mirror.get(session_id)
        return (snap.turns, snap.est_accepted_share_ewma) if snap is not None else (0, None)

    def snapshots(self) -> list[SessionSnapshot]:
        return [snap for sid in reversed(self._mirror) if (snap := self._mirror.get(sid)) is not None]

    def expire(self) -> None:
        """The child expires its own sessions with each update; the snapshots here follow now and then (a look at
        every session after every update was a scan per request)."""
        idle, now = self.template.idle_expiry_s, time.time()
        if now - self._mirror_expired_at < _MIRROR_EXPIRY_EVERY_S:
            return
        self._mirror_expired_at = now
        for sid, snap in self._mirror.items():
            if now - snap.last_seen > idle:
                self._mirror.pop(sid)

    async def expire_idle(self) -> None:
        if self._process is not None:
            for sid in await self._call(updates.process_expire, time.time()):
                self._mirror.pop(sid)
        self.expire()

    async def start(self) -> None:
        # Now, not on the first update: spawning it and importing takes a second or more, and the turns served
        # meanwhile would wait (and coalesce) behind the first.
        await self._call(updates.process_expire, time.time())

    def close(self) -> None:
        if self._process is not None:
            self._process.close()
            self._process = None

    def counts(self) -> dict[str, int]:
        return {"updates_sent_new_only": self.sent_new_only, "updates_sent_again": self.sent_again}

    async def update(self, work: Work, tokenizer: Tokenizer) -> Folded:
        if self.spec is not None and work.raw:
            return await self._update_in_child(work)
        pick = await self._call(updates.process_pick, work.session_id, work.body)
        job = await _fold_job(work, pick, None, tokenizer)
        turn, snap, gone = await self._call(updates.process_fold_expire, job, time.time())
        self._folded(work, snap, gone)
        return turn, snap

    async def _update_in_child(self, work: Work) -> Folded:
        """The whole update in the child: it parses the client's bytes and tokenizes. A turn that repeats the
        messages of the request folded last is sent only what follows them, unless the child no longer has that."""
        messages = messages_of(work.body)

        def fold(raw: bytes, after: tuple[str, int] | None = None) -> Awaitable[tuple[Any, ...] | None]:
            return self._call(
                session_worker.update, work.session_id, work.project, raw, work.output_text, work.at, work.side,
                work.line_moved, time.time(), work.turns, work.output_calls, work.request_id, after,
            )  # fmt: skip

        result = None
        rest = self._rest(work, messages)
        if rest is not None:
            after, raw_rest = rest
            self.sent_new_only += 1
            result = await fold(raw_rest, after)
            self.sent_again += result is None
        if result is None:
            result = await fold(work.raw)
        assert result is not None  # the whole body is always folded
        turn, snap, gone = result
        if self._mirror.get(work.session_id) is not None:
            # Kept from a session's second update on: a conversation of one request (a retry, a new one without an
            # id) would only hold its parsed body in memory.
            self._sent.put(work.session_id, _Sent(work.request_id, messages, len(work.raw)))
        self._folded(work, snap, gone)
        return turn, snap

    def _rest(self, work: Work, messages: list[Any]) -> tuple[tuple[str, int], bytes] | None:
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

    def _folded(self, work: Work, snap: SessionSnapshot | None, gone: list[str]) -> None:
        for sid in gone:
            self._mirror.pop(sid)
            self._sent.pop(sid)
        if snap is not None:
            self._mirror.put(work.session_id, snap)

    async def _call(self, func: Callable[..., Any], *args: Any) -> Any:
        """`func(*args)` in the child (started on first use; started again if it died). A child that cannot make
        the tokenizer again goes on without it: the event loop tokenizes."""
        if self._process is None:
            settings = updates.tracker_settings(self.template)
            if self.spec is not None:
                self._process = WorkerProcess(session_worker.init, (settings, self.spec), niceness=WORKER_NICENESS)
            else:
                self._process = WorkerProcess(updates.process_init, (settings,), niceness=WORKER_NICENESS)
        process = self._process
        try:
            return await process.call(func, *args)
        except WorkerFailed as exc:
            if not process.closed:
                raise  # the function failed; the process lives on
            log.warning("the session statistics worker could not start (%s); tokenizing on the event loop", exc)
            self._process, self.spec = None, None
            raise
        except WorkerDied:
            log.warning("the session statistics worker process died; starting another (statistics start over)")
            self._process = None
            self._mirror = LRU(self.template.max_sessions)
            self._sent = LRU(_SENT_SESSIONS, max_weight=_SENT_BYTES, weigh=lambda sent: sent.weight)
            raise


async def _fold_job(work: Work, pick: Any, digests: list[bytes] | None, tokenizer: Tokenizer) -> updates.FoldJob:
    """The texts the pick names, tokenized by the proxy's tokenizer, and the job that folds them."""
    picked = updates.picked_texts(work.body, pick)
    tokens = await tokenizer.encode([*(text for _, text in picked), work.output_text])
    return updates.FoldJob(
        work.session_id, work.project, tokens[:-1], work.output_text, tokens[-1], work.at, work.side,
        work.line_moved, digests, work.turns, [role for role, _ in picked], work.output_calls,
    )  # fmt: skip
