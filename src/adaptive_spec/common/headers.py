"""The HTTP header names adaptive-spec reads and writes, defined once: the proxy, the session grouping and the bench
all speak these."""

from __future__ import annotations

PROFILE_HEADER = "x-adaptive-spec-profile"  # request: pin a profile; response: the profile that served it
ROUTE_HEADER = "x-adaptive-spec-route"  # response: the kind of routing decision (estimate, stay, pinned, ...)
REPLICA_HEADER = "x-adaptive-spec-replica"  # response, for a profile with a pool: which replica served it
REQUEST_ID_HEADER = "x-adaptive-spec-request-id"  # sent upstream and back: which request this is
SESSION_ID_HEADER = "x-session-id"  # the plainest way to name a session (the bench names its sessions with it)
# A session id the client names, in the order they are looked for (any other x-*-session-id counts too).
SESSION_HEADERS = (SESSION_ID_HEADER, "x-session-affinity", "session-id", "session_id", "x-claude-code-session-id")
PARENT_SESSION_HEADERS = ("x-parent-session-id", "x-claude-code-parent-session-id")
SUBAGENT_HEADERS = ("x-openai-subagent", "x-subagent", "x-claude-code-subagent")
