"""Benchmark workloads: a documented JSON format, its checks, and the replay that keeps inputs identical.

A workload is `{"format": "adaptive-spec-workload/1", "name", "description", "sessions": {id: {"system"}},
"requests": [{"session", "user" | "messages", "max_tokens"}]}` (docs/workloads.md). A request with `user` appends that
message to its session's history; its reply joins the history before the session's next request. A request with
`messages` is sent as given (what a trace converts into).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from adaptive_spec.errors import ConfigError

FORMAT = "adaptive-spec-workload/1"


class WorkloadError(ConfigError):
    pass


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    index: int
    session: str
    max_tokens: int
    user: str | None = None
    messages: tuple[Mapping[str, Any], ...] | None = None


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    description: str
    systems: Mapping[str, str]
    requests: tuple[WorkloadRequest, ...]


def _need(obj: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
    value = obj.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise WorkloadError(f"{where}.{key}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def parse_workload(obj: Any, source: str) -> Workload:
    """Check a decoded workload file; errors name the file and the dotted key."""
    if not isinstance(obj, dict):
        raise WorkloadError(f"{source}: a workload is a JSON object")
    if obj.get("format") != FORMAT:
        raise WorkloadError(f"{source}: format: expected {FORMAT!r}, got {obj.get('format')!r}")
    sessions = _need(obj, "sessions", dict, source)
    systems = {sid: str(s.get("system", "")) if isinstance(s, dict) else "" for sid, s in sessions.items()}
    requests = []
    for i, raw in enumerate(_need(obj, "requests", list, source)):
        where = f"{source}: requests[{i}]"
        if not isinstance(raw, dict):
            raise WorkloadError(f"{where}: expected an object")
        session = _need(raw, "session", str, where)
        max_tokens = _need(raw, "max_tokens", int, where)
        user, messages = raw.get("user"), raw.get("messages")
        if (user is None) == (messages is None):
            raise WorkloadError(f"{where}: give exactly one of 'user' or 'messages'")
        if user is not None and not isinstance(user, str):
            raise WorkloadError(f"{where}.user: expected str")
        if messages is not None and not (isinstance(messages, list) and all(isinstance(m, dict) for m in messages)):
            raise WorkloadError(f"{where}.messages: expected a list of message objects")
        if user is not None and session not in systems:
            raise WorkloadError(f"{where}.session: {session!r} is not in 'sessions'")
        requests.append(WorkloadRequest(i, session, max_tokens, user, tuple(messages) if messages else None))
    if not requests:
        raise WorkloadError(f"{source}: requests: the workload has none")
    return Workload(str(obj.get("name") or source), str(obj.get("description") or ""), systems, tuple(requests))


@dataclass
class Replay:
    """Builds each request's messages from its session's history; the caller feeds back the reply to keep."""

    workload: Workload
    # Put at the very start of each system prompt: a pass that sees another tag can reuse no cached prompt of it.
    tag: str = ""
    _history: dict[str, list[dict[str, str]]] = field(default_factory=dict)

    def messages_for(self, request: WorkloadRequest) -> list[Mapping[str, Any]]:
        if request.messages is not None:
            return list(request.messages)
        history = self._history.get(request.session, [])
        system = self.workload.systems.get(request.session, "")
        if self.tag:
            system = f"[{self.tag}] {system}".strip()
        head = [{"role": "system", "content": system}] if system else []
        return [*head, *history, {"role": "user", "content": request.user or ""}]

    def keep_reply(self, request: WorkloadRequest, reply: str) -> None:
        if request.user is not None:
            history = self._history.setdefault(request.session, [])
            history += [{"role": "user", "content": request.user}, {"role": "assistant", "content": reply}]


def workload_from_trace(lines: Iterable[Mapping[str, Any]], name: str) -> dict[str, Any]:
    """A workload (as JSON) from trace lines written with --trace-content: each request replayed as sent."""
    requests: list[dict[str, Any]] = []
    for line in lines:
        body = line.get("request_body")
        if line.get("kind") != "request" or not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            continue
        timings = line.get("timings") or {}
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or timings.get("predicted_n") or 256
        requests.append(
            {
                "session": str(line.get("session_id") or f"r{len(requests)}"),
                "messages": body["messages"],
                "max_tokens": int(max_tokens),
            }
        )
    if not requests:
        raise WorkloadError("the trace holds no chat requests with content (record it with --trace-content)")
    return {
        "format": FORMAT,
        "name": name,
        "description": "converted from a trace",
        "sessions": {},
        "requests": requests,
    }
