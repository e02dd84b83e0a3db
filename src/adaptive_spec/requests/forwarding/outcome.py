"""How a request ended: one value from the first refusal to the last chunk.

Its status, the error as the client is told it (message, code, parameter), whether the client went away and whether the
server was never reached; the request's record, its finished-or-failed event and a refusal's answer are all made from
it. Pure."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Outcome:
    status: int
    error: str | None = None
    code: str | None = None  # the error's code in the answer's body (OpenAI's shape)
    param: str | None = None  # the request field the error is about
    client_gone: bool = False  # the client hung up while the answer was being written to it
    # Nothing came back from the server (it refused the connection, or stopped answering and the request was ended):
    # a pool may send it to another replica while nothing went out to the client.
    unreachable: bool = False

    @property
    def finished(self) -> bool:
        """Served: no error, a status below 400."""
        return self.error is None and self.status < 400


NOT_ANSWERED = Outcome(500, "the proxy stopped before the request was answered")
SHUTDOWN = Outcome(
    503,
    "adaptive-spec is shutting down: the request ran past the shutdown grace and was ended",
    "proxy_shutting_down",
)
CLIENT_GONE = Outcome(499, "the client disconnected", client_gone=True)
SERVED = Outcome(200)
