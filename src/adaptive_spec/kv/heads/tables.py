"""The head store's tables: what the store knows of the servers and decides from it, as plain data owned here and
changed only through these methods — each server's traffic (`ServerActivity`), the head each slot holds, the first
requests of sessions under way and the head restored for each, and the verdicts on inert restores — and what a route
sees of a server (`view`).

Synchronous and pure: no file, no HTTP, no lock. The store (`kv/heads/store.py`) is its I/O executor: it asks the
tables, does the slow work, and tells them what came of it."""

from __future__ import annotations

from collections.abc import Iterable

from adaptive_spec.common.lru import LRU
from adaptive_spec.kv.heads.activity import Mark, ServerActivity, Verdict
from adaptive_spec.kv.heads.matching import HeadEntry, ServerKey
from adaptive_spec.kv.heads.values import HeadsView, Restored

_FIRSTS = 4096  # first requests under way (bounded: one that raised never ends)


class HeadTables:
    def __init__(self, tenants: bool = False) -> None:
        """`tenants`: projects are tenants (`serve --project-key`): restores pause on a server only after heads of two
        tenants in a row were inert there."""
        self._tenants = tenants
        self._activity = ServerActivity()
        self._held: dict[tuple[str, int], Restored] = {}  # the head each server's slot holds (warm start, save)
        self._firsts: LRU[str, Restored | None] = LRU(_FIRSTS)

    # -- each server's traffic -------------------------------------------------------------------------------------

    def arriving(self, scope: str, session_id: str, server: str) -> bool:
        """Whether this request of the session is the first the store sees of it (a new session, or one resumed
        after `serve` restarted), or its first since its server restarted; it is seen from now on."""
        return self._activity.arriving((scope, session_id), server)

    def forwarded(self, server: str, slot: int | None, request_id: str | None = None) -> None:
        """A request forwarded to `server` (naming `slot`, or none), or a KV move into that slot."""
        self._activity.forwarded(server, slot, request_id)

    def forwarded_to(self, server: str) -> int:
        return self._activity.forwarded_to(server)

    def mark(self, server: str, slot: int | None) -> Mark:
        return self._activity.mark(server, slot)

    def mark_of(self, request_id: str) -> Mark | None:
        """The request's mark as it was forwarded (None: not forwarded through `forwarded`)."""
        return self._activity.mark_of(request_id)

    def restarted(self, server: str) -> None:
        """The server went down: its slots are gone, and its sessions arrive again when it is back."""
        self._activity.restarted(server)
        self.emptied(server)

    # -- the heads slots hold --------------------------------------------------------------------------------------

    def hold(self, server: str, slot: int, restored: Restored) -> None:
        """The slot holds that head now (a warm start restored it there, or it was saved from there)."""
        self._held[(server, slot)] = restored

    def emptied(self, server: str) -> None:
        """Its slots were erased: no head is held there any more."""
        for key in [k for k in self._held if k[0] == server]:
            del self._held[key]

    def holds(self, server: str, slot: int, head: str) -> Restored | None:
        """What the slot holds of `head`, no request having come to the server since it was put there; else None."""
        held = self._held.get((server, slot))
        if held is None or held.head != head or held.forwards != self.forwarded_to(server):
            return None
        return held

    # -- first requests under way ----------------------------------------------------------------------------------

    def begin(self, request_id: str, restored: Restored | None) -> None:
        self._firsts.put(request_id, restored)

    def end(self, request_id: str) -> tuple[bool, Restored | None]:
        """Whether this request was a first one the store saw (and what was restored for it)."""
        if request_id not in self._firsts:
            return False, None
        return True, self._firsts.pop(request_id)

    # -- verdicts on restores --------------------------------------------------------------------------------------

    def paused(self, server: str, now: float) -> bool:
        """Restores pause on the server (after inert restores there)."""
        return self._activity.is_inert(server, now)

    def inert_servers(self, now: float) -> list[str]:
        return self._activity.inert_servers(now)

    def reused(self, server: str) -> None:
        """A restore there was reused."""
        self._activity.reused(server)

    def heard_inert(self, server: str, head: str, until: float, server_until: float | None) -> None:
        """Another proxy found a restore of `head` on `server` inert: not restored there until `until`; with
        `server_until`, restores pause there until then."""
        self._activity.inert_heads[(server, head)] = max(until, self._activity.inert_heads.get((server, head), 0.0))
        if server_until is not None:
            self._activity.inert[server] = max(server_until, self._activity.inert.get(server, 0.0))

    def judge(self, server: str, restored: Restored, scope: str, now: float) -> tuple[Verdict, int]:
        """A restore on `server` its request did not reuse: whose fault (`ServerActivity.judge`), and how many heads
        in a row."""
        return self._activity.judge(server, restored.forwards, restored.head, scope, now, tenants=self._tenants)

    # -- what a route sees -----------------------------------------------------------------------------------------

    def view(
        self,
        server: str,
        key: ServerKey,
        scope: str,
        entries: Iterable[HeadEntry],
        restore_bytes_per_s: float,
        any_prefix: bool,
        now: float,
    ) -> HeadsView:
        """The server as a route sees it (`HeadsView`): of `entries` (the heads usable there), those whose restore
        was not inert there lately, and the heads its slots hold untouched."""
        usable = tuple(e for e in entries if not self._activity.head_inert(server, e.id, now))
        since = self.forwarded_to(server)
        held = {slot: h for (where, slot), h in self._held.items() if where == server and h.forwards == since}
        return HeadsView(server, key, scope, usable, held, restore_bytes_per_s, any_prefix)

    def would_arrive(self, scope: str, session_id: str, server: str) -> bool:
        """Whether a request of the session would be `arriving` there now (nothing is counted)."""
        return self._activity.would_arrive((scope, session_id), server)
