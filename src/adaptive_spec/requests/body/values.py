"""A request's body as the proxy's reading stages make it, each value once: what it received (`Received`), what it
read of it (`Prepared`: parsed, grouped, its policy resolved) and the body sent instead (`Rewrite`).

Pure."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from adaptive_spec.policy.model import Policy
from adaptive_spec.requests.body.parse import ParsedRequest
from adaptive_spec.requests.body.repeats import Guarded
from adaptive_spec.requests.gemini.request import GeminiCall
from adaptive_spec.sessions.grouping import SessionAssignment
from adaptive_spec.sessions.project import DEFAULT_PROJECT


@dataclass(frozen=True, slots=True)
class Received:
    """The request's body as it stands for the request, made once by the reading stage (`handler.receive`): the
    client's bytes, or a Gemini request's translated into the chat completion llama-server is sent (routing, sessions
    and the trace then read what llama-server reads), with what its client asked for (`gemini`)."""

    body: bytes = b""
    gemini: GeminiCall | None = None


@dataclass(frozen=True, slots=True)
class Prepared:
    """A generating request as the proxy read it, once: its parsed body, the workspace its agent revealed, its session,
    its project, and the policy of that project and workspace, resolved before routing (its files read in a thread
    the first time: nothing after it reads a policy file)."""

    parsed: ParsedRequest
    workspace: str | None = None
    assignment: SessionAssignment | None = None
    project: str = DEFAULT_PROJECT
    policy: Policy = field(default_factory=Policy)


@dataclass(frozen=True, slots=True)
class Rewrite:
    """The body sent upstream instead of the client's, and why: a shape llama-server refuses repaired
    (requests/body/compat.py), an agent's loop on one tool call broken (requests/body/repeats.py)."""

    body: dict[str, Any]
    raw: bytes
    repaired: str | None = None
    guard: Guarded | None = None
