"""The agents' waits that the proxy's prefill keep-alives cannot reset, read from each agent's source
(examples/README.md has the whole table of their timers): what each gives up after, and what to set instead.

Said once when `serve` starts, and in the record of a request from such an agent that waited for its first token
for half its limit or more, so a first turn given up on a slow machine names its cause."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WaitLimit:
    """One agent's wait that no keep-alive resets."""

    client: str  # as `clients.client_name` names the agent
    agent: str  # as people know it
    limit_s: float  # its default
    setting: str  # what raises it
    why: str  # why the keep-alives do not reset it

    def describe(self) -> str:
        return f"{self.agent} gives up after {self.limit_s:.0f} s ({self.why}): raise {self.setting}"


LIMITS = (
    WaitLimit(
        "claude-code",
        "Claude Code",
        300.0,
        "CLAUDE_STREAM_IDLE_TIMEOUT_MS",
        "its stream watchdog counts the SDK's events, and the SDK drops `ping`",
    ),
    WaitLimit(
        "qwen-code",
        "Qwen Code",
        900.0,
        "QWEN_STREAM_MAX_LIFETIME_MS",
        "a cap on a stream's whole wait, chunks or not",
    ),
    WaitLimit(
        "codex",
        "Codex CLI",
        300.0,
        "stream_idle_timeout_ms",
        "it counts SSE data events; the keep-alive on /v1/responses is a comment",
    ),
    WaitLimit(
        "opencode",
        "opencode",
        300.0,
        'the provider\'s options "timeout"',
        "a deadline on the whole request",
    ),
)
_BY_CLIENT = {limit.client: limit for limit in LIMITS}
NEAR = 0.5  # a wait of this share of the limit or more is named in the record


def start_line() -> str:
    """What `serve` says at start."""
    return "agents: waits the keep-alives cannot reset on a long prefill: " + "; ".join(
        limit.describe() for limit in LIMITS
    )


def wait_note(client: str | None, waited_ms: float | None) -> str | None:
    """The record's note for a request from `client` that waited `waited_ms` for its first token (or, with none, for
    its end); None: no such limit for this agent, or the wait was well within it."""
    limit = _BY_CLIENT.get(client or "")
    if limit is None or waited_ms is None or waited_ms < NEAR * limit.limit_s * 1000.0:
        return None
    return f"waited {waited_ms / 1000.0:.0f} s; {limit.describe()}"
