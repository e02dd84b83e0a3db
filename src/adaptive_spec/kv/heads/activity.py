"""What the head store knows of each llama-server's traffic, as counts: the requests forwarded to it (all, those that
named no slot, those that named each slot), its restarts, the sessions seen on it, and the restores it made inert.

The store compares these counts before and after each save or restore: a request forwarded in between may have taken the
slot. Where several proxies share llama-servers (`serve --shared-state`), a proxy's own counts miss the others'
requests: the counts they keep together (`Counted`, read through `SharedForwards`) are compared as well. A request is
counted per server (all requests, those that named no slot, those that named each slot) in the round trip that books
its slot, and its shared mark is the counts that booking returned; a guard reads them again (one round trip, off the
request path) and compares: any difference, any count it cannot read, and a mark taken while another proxy's request
could still reach that slot mean another request may have used the slot, so nothing is saved. Pure and synchronous
(but for the protocol's read): the store calls it on the event loop."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from adaptive_spec.common.lru import LRU

INERT_STRIKES = 2  # inert restores of as many heads in a row on a server before restores pause there
INERT_SERVER_S = 600.0  # how long restores pause on a server that made them inert (then they are tried again)
INERT_HEAD_S = 3600.0  # how long a head whose restore was inert is not restored on that server
_SESSIONS = 100_000
_MARKS = 4096

# What had been forwarded that could have used a slot: (requests, 0) when no slot is named; else (the requests that
# named no slot, those that named this one).
Mark = tuple[int, int]


class Verdict(Enum):
    TAKEN = "taken"  # another request came between the restore and its own: not the restore's fault
    STRIKE = "strike"  # inert: that head is not restored there for a while; more such and restores pause there
    INERT = "inert"  # inert for `INERT_STRIKES` heads in a row (of two tenants, with tenants): restores pause there
    # Inert on a server that has reused restores this run (it restores): that head alone is not restored there again.
    # One client's prompts (a whitespace variant of a head, say) cannot switch restores off for everyone.
    HEAD = "head"


@dataclass
class ServerActivity:
    """The counts, by server (its base URL)."""

    forwards: dict[str, int] = field(default_factory=dict)  # requests forwarded to each server
    unpinned: dict[str, int] = field(default_factory=dict)  # of those, the ones that named no slot
    pinned: dict[tuple[str, int], int] = field(default_factory=dict)  # and the ones that named a slot, by slot
    generations: dict[str, int] = field(default_factory=dict)  # restarts: a restarted server lost every session's KV
    # Sessions seen: the server and its generation at their latest request.
    seen: LRU[tuple[str, str], tuple[str, int]] = field(default_factory=lambda: LRU(_SESSIONS))  # by (scope, id)
    # What had been forwarded that could use each request's slot, its own forward included (`mark`): a later one,
    # even one sent while the request still ran, leaves that slot holding another prompt.
    marks: LRU[str, Mark] = field(default_factory=lambda: LRU(_MARKS))
    inert: dict[str, float] = field(default_factory=dict)  # servers where restores pause, until when (`judge`)
    # The heads whose restores were inert in a row, by server, each with its tenant scope.
    strikes: dict[str, dict[str, str]] = field(default_factory=dict)
    proven: set[str] = field(default_factory=set)  # servers where a restore was reused this run
    # (server, head) -> until when that head is not restored there.
    inert_heads: dict[tuple[str, str], float] = field(default_factory=dict)

    def arriving(self, session_id: tuple[str, str], server: str) -> bool:
        """Whether this is the first request seen of the session, or its first since its server restarted (and it is
        seen from now on)."""
        first = self.would_arrive(session_id, server)
        self.seen.put(session_id, (server, self.generations.get(server, 0)))
        return first

    def would_arrive(self, session_id: tuple[str, str], server: str) -> bool:
        """Whether a request of the session would be `arriving` there now (nothing is counted)."""
        before = self.seen.get(session_id)
        return before is None or (before[0] == server and before[1] != self.generations.get(server, 0))

    def forwarded(self, server: str, slot: int | None, request_id: str | None) -> None:
        self.forwards[server] = self.forwards.get(server, 0) + 1
        if slot is None:
            self.unpinned[server] = self.unpinned.get(server, 0) + 1
        else:
            self.pinned[(server, slot)] = self.pinned.get((server, slot), 0) + 1
        if request_id is not None:
            self.marks.put(request_id, self.mark(server, slot))

    def forwarded_to(self, server: str) -> int:
        return self.forwards.get(server, 0)

    def mark(self, server: str, slot: int | None) -> Mark:
        """What has been forwarded that could have used `slot` so far: every request when no slot is named; else
        the requests that named no slot and those that named this one."""
        if slot is None:
            return self.forwards.get(server, 0), 0
        return self.unpinned.get(server, 0), self.pinned.get((server, slot), 0)

    def mark_of(self, request_id: str) -> Mark | None:
        """The request's `mark` as it was forwarded (None: not forwarded through `forwarded`)."""
        return self.marks.pop(request_id)

    def restarted(self, server: str) -> None:
        self.generations[server] = self.generations.get(server, 0) + 1

    def reused(self, server: str) -> None:
        """A restore there was reused: the strikes start again, and the server is known to restore."""
        self.strikes.pop(server, None)
        self.proven.add(server)

    def is_inert(self, server: str, now: float) -> bool:
        """Restores pause on the server (a verdict that has expired is forgotten)."""
        until = self.inert.get(server)
        if until is not None and until <= now:
            del self.inert[server]
            return False
        return until is not None

    def inert_servers(self, now: float) -> list[str]:
        """The servers where restores pause now, sorted (`is_inert`)."""
        return sorted(s for s in list(self.inert) if self.is_inert(s, now))

    def head_inert(self, server: str, head: str, now: float) -> bool:
        until = self.inert_heads.get((server, head))
        if until is not None and until <= now:
            del self.inert_heads[(server, head)]
            return False
        return until is not None

    def judge(
        self,
        server: str,
        forwards_at_restore: int,
        head: str = "",
        scope: str = "",
        now: float = 0.0,
        tenants: bool = False,
    ) -> tuple[Verdict, int]:
        """A restore of `head` (of tenant `scope`) there was not reused by its request: whose fault, and how many
        heads in a row so far. The head is not restored there for `INERT_HEAD_S`; restores pause on the server (for
        `INERT_SERVER_S`) only after `INERT_STRIKES` heads in a row on a server that never reused one, and with
        `tenants`, heads of two scopes: no one client's prompts turn restores off for everyone, nor for long."""
        if self.forwards.get(server, 0) != forwards_at_restore + 1:
            return Verdict.TAKEN, len(self.strikes.get(server, {}))
        self.inert_heads[(server, head)] = now + INERT_HEAD_S
        if server in self.proven:
            return Verdict.HEAD, len(self.strikes.get(server, {}))
        row = self.strikes.setdefault(server, {})
        row[head] = scope
        if len(row) < INERT_STRIKES or (tenants and len(set(row.values())) < 2):
            return Verdict.STRIKE, len(row)
        self.inert[server] = now + INERT_SERVER_S
        del self.strikes[server]
        return Verdict.INERT, len(row)


@dataclass(frozen=True, slots=True)
class Counted:
    """One server's shared forward counts, as a booking returned them (its own request included) or a guard read them.

    `epoch` names the counters' life (a store flushed or restarted, or the counters expired, starts a new one: no count
    before it compares equal to one after); `slot` is the slot whose count `in_slot` is (None: the request named none,
    and `in_slot` is `unnamed`). `contested`: when the booking counted, another proxy's live booking could still use
    that slot (its request may reach the server after this one), so the counts cannot tell what the slot holds."""

    epoch: str
    forwards: int  # every request forwarded to the server, by any proxy
    unnamed: int  # of those, the ones that named no slot
    slot: int | None
    in_slot: int
    contested: bool = False

    def unchanged(self, now: Counted | None, slot: int | None) -> bool:
        """Whether nothing was counted since this mark that could have used `slot` (None: any slot of the server):
        the requests that named no slot and those that named `slot`; every request where no slot is known."""
        if now is None or self.contested or now.epoch != self.epoch:
            return False
        if slot is None or self.slot != slot or now.slot != slot:
            return now.forwards == self.forwards
        return (now.unnamed, now.in_slot) == (self.unnamed, self.in_slot)


def alone_after(booked: Counted | None, after_restore: Counted | None) -> bool:
    """Whether no other request was counted on the server between a request's booking and the end of the head restore
    made for it (then none came between the restore and the request, but for one sent in the moment between that read
    and its own forward): only then may a restore its request did not reuse be blamed on the head."""
    if booked is None or after_restore is None or booked.contested:
        return False
    return after_restore.epoch == booked.epoch and after_restore.forwards == booked.forwards


@dataclass(frozen=True, slots=True)
class TurnMark:
    """A request's mark as it was forwarded: what this proxy had forwarded that could use its slot (`activity.Mark`),
    and, where proxies share state, the shared counts its booking returned (None there: not counted, so no save)."""

    local: Mark
    shared: Counted | None = None


class SharedForwards(Protocol):
    """Where the forward counts all proxies share are kept (`shared_state/heads.py`)."""

    def booked(self, request_id: str) -> Counted | None:
        """The counts the request's booking returned (once; None: not booked, or the store could not be reached)."""
        ...

    async def read(self, server: str, slot: int | None) -> Counted | None:
        """The counts now (one round trip; None: the store cannot be reached, or holds nothing it can read)."""
        ...
