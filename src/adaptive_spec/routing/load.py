"""Each llama-server's slots and load, as the router counts them: which (profile, replica) runs on which server
(profiles that are per-request settings of one server share it), each server's slot book, the requests in flight per
server and per session, and the acceptance counts per replica.

Pure bookkeeping: `Router` starts and ends requests on it."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from adaptive_spec.llama.profiles import uses_draft_model
from adaptive_spec.routing.contract import ProfileHealth
from adaptive_spec.routing.estimate import ProfileState
from adaptive_spec.routing.placements import Placement, Placements, SlotBook
from adaptive_spec.routing.replicas import ReplicaState, least_loaded
from adaptive_spec.telemetry.records import Timings


class ServerBooks:
    def __init__(
        self,
        health: ProfileHealth,
        slots: Mapping[str, int],
        replica_slots: Mapping[tuple[str, int], int] | None = None,
        servers: Mapping[tuple[str, int], str] | None = None,
    ) -> None:
        """`slots`: each profile's slots per server; `replica_slots` overrides it for a (profile, replica).
        `servers`: the server a (profile, replica) shares with others: those share its slots, its load and its
        sessions' KV; one not named has a server of its own."""
        self.health = health
        per_replica, shared = replica_slots or {}, servers or {}
        first: dict[str, tuple[str, int]] = {}
        # Each (profile, replica) → the first (profile, replica) of its server: the key of the server's own state.
        self._home: dict[tuple[str, int], tuple[str, int]] = {}
        for n in health.names():
            for i in range(len(health.replica_health(n))):
                server = shared.get((n, i))
                self._home[(n, i)] = first.setdefault(server, (n, i)) if server is not None else (n, i)
        books = {h: SlotBook(max(1, per_replica.get(h, slots.get(h[0], 1)))) for h in set(self._home.values())}
        self._books = {key: books[home] for key, home in self._home.items()}  # one book per server
        self.in_flight: dict[str, int] = dict.fromkeys(health.names(), 0)  # per profile
        self.replica_in_flight: dict[tuple[str, int], int] = dict.fromkeys(books, 0)  # per server (its home key)
        # Per replica: requests served, output, drafted and accepted tokens (acceptance per replica, for telemetry).
        self.replica_counts: dict[tuple[str, int], dict[str, int]] = {
            k: {"requests": 0, "predicted_n": 0, "draft_n": 0, "draft_n_accepted": 0} for k in self._books
        }
        self.sessions_in_flight: dict[str, tuple[str, int]] = {}  # session -> (profile, requests being served)
        # Per server (its home key): the requests other proxies booked there (shared state; none with one proxy).
        self._elsewhere: dict[tuple[str, int], int] = {}
        # Per server: the sessions whose KV other proxies left in its slots (a new session goes where none is).
        self.sessions_elsewhere: dict[tuple[str, int], int] = {}

    def booked_elsewhere(self, by_home: Mapping[tuple[str, int], Mapping[int, int]]) -> None:
        """What other proxies have booked on each server, slot by slot (-1: a request that named no slot), as the
        shared state said just now: it replaces what it said before. Servers not named have nothing booked."""
        self._elsewhere = {home: sum(slots.values()) for home, slots in by_home.items() if slots}
        for home in set(self._home.values()):
            book = self._books[home]
            book.elsewhere = {s: n for s, n in by_home.get(home, {}).items() if s >= 0 and n > 0}

    def occupied_elsewhere(
        self, by_home: Mapping[tuple[str, int], Mapping[int, str]], mine: Callable[[str], bool]
    ) -> None:
        """Which session each slot of each server holds, as other proxies wrote it: a slot holding a session this
        proxy did not place counts as used just now (a new session takes an empty one first), and the server as
        holding that many more sessions."""
        now = time.monotonic()
        self.sessions_elsewhere = {}
        for home, slots in by_home.items():
            book = self._books.get(home)
            if book is None:
                continue
            for slot, session in slots.items():
                if not mine(session) and 0 <= slot < book.slots:
                    book.last_used[slot] = max(book.last_used.get(slot, 0.0), now)
                    self.sessions_elsewhere[home] = self.sessions_elsewhere.get(home, 0) + 1

    def holds(self, profile: str, placement: Placement | None) -> int | None:
        """The replica of `profile` whose server holds the session's KV (its own profile's, or one sharing it)."""
        return self.same_server(placement.profile, placement.replica, profile) if placement is not None else None

    def holds_up(self, placement: Placement | None) -> bool:
        """Whether the replica holding the session's KV is up (its slot can be saved for a handoff)."""
        if placement is None:
            return False
        source = self.health.replica_health(placement.profile)
        return placement.replica < len(source) and source[placement.replica][1] is None

    def preview_replica(self, profile: str, placement: Placement | None, replicas: list[ReplicaState]) -> int:
        """The replica a request would use before the overload check: its KV's, else the least loaded one."""
        held = self.holds(profile, placement)
        if held is not None and held < len(replicas) and replicas[held].down_reason is None:
            return held
        best = least_loaded(replicas)
        return best.index if best is not None else 0

    def server_url(self, profile: str, replica: int = 0) -> str:
        """The base URL of the server (profile, replica) runs on: the name proxies that share state give it."""
        home = self.home(profile, replica)
        health = self.health.replica_health(home[0])
        return health[home[1]][0] if home[1] < len(health) else ""

    def adopt(
        self,
        placements: Placements,
        session_id: str | None,
        placement: Placement | None,
        booked: Mapping[str, Mapping[int, int]],
        occupants: Mapping[str, Mapping[int, str]] | None = None,
    ) -> None:
        """What the other proxies said just before a request of `session_id` is routed: where the session's KV lives
        (their placement of it, newer than this proxy's: taken into `placements`), the requests they have booked on
        each server (by its URL, slot by slot; -1: a request that named none), and which session each slot holds."""
        names = self.health.names()
        homes = {
            self.server_url(n, i): self.home(n, i) for n in names for i in range(len(self.health.replica_health(n)))
        }
        self.booked_elsewhere({homes[url]: slots for url, slots in booked.items() if url in homes})
        held = {homes[url]: slots for url, slots in (occupants or {}).items() if url in homes}
        # This proxy's own sessions: placed, or in flight (their booking names them before the router places them).
        self.occupied_elsewhere(
            held,
            lambda sid: sid == session_id or placements.get(sid) is not None or sid in self.sessions_in_flight,
        )
        if session_id is not None and placement is not None:
            placements.adopt(session_id, placement)
            self.remember_slot(placement.profile, placement.replica, session_id, placement.slot)

    def remember_slot(self, profile: str, replica: int, session_id: str, slot: int | None) -> None:
        """The slot another proxy gave the session on this server (its KV is there)."""
        book = self._books.get((profile, replica))
        if book is not None and book.slots > 1 and slot is not None and 0 <= slot < book.slots:
            book.by_session.put(session_id, slot)

    def _in_flight(self, home: tuple[str, int]) -> int:
        return self.replica_in_flight.get(home, 0) + self._elsewhere.get(home, 0)

    def home(self, profile: str, replica: int = 0) -> tuple[str, int]:
        """The key of the server that (profile, replica) runs on: itself, or the first profile of a shared server."""
        return self._home.get((profile, replica), (profile, replica))

    def same_server(self, profile: str, replica: int, other: str) -> int | None:
        """The replica of profile `other` that runs on the same server as (profile, replica), or None."""
        if other == profile:
            return replica
        home = self.home(profile, replica)
        return next((i for i in range(len(self.health.replica_health(other))) if self.home(other, i) == home), None)

    def book(self, profile: str, replica: int = 0) -> SlotBook:
        return self._books.get((profile, replica)) or SlotBook(1)

    def slot_count(self, profile: str, replica: int = 0) -> int:
        return self._books[(profile, replica)].slots

    def server_busy(self, profile: str, replica: int = 0) -> int:
        """Requests running on the server of (profile, replica), whichever profile they came for (and whichever
        proxy sent them)."""
        return self._in_flight(self.home(profile, replica))

    def slot_key(self, profile: str, session_id: str | None, replica: int = 0) -> int | None:
        book = self._books[(profile, replica)]
        return book.by_session.get(session_id) if book.slots > 1 and session_id is not None else None

    def slot_busy(self, profile: str, slot: int | None, mine: int, replica: int = 0) -> bool:
        """Whether requests other than `mine` (0 or 1: this request's own, counted already) occupy the slot."""
        book = self._books[(profile, replica)]
        if book.slots > 1 and slot is not None:
            return book.busy.get(slot, 0) + book.elsewhere.get(slot, 0) > mine
        return self._in_flight(self.home(profile, replica)) > mine

    def slot_for(self, profile: str, session_id: str | None, replica: int = 0, side: bool = False) -> int | None:
        """The slot to name with `id_slot`, on profiles with several slots (None: let the server choose); a side
        request's is not its session's."""
        book = self._books[(profile, replica)]
        return book.pick(session_id, side) if book.slots > 1 else None

    def replica_states(self, profile: str, placements: Placements, count_sessions: bool = False) -> list[ReplicaState]:
        """`sessions` (placed on each replica) is counted for a pool, or when asked: a scan of the placements."""
        health = self.health.replica_health(profile)
        count_sessions = count_sessions or len(health) > 1
        states = []
        for i, (url, down) in enumerate(health):
            book = self.book(profile, i)
            in_flight = self._in_flight(self.home(profile, i))
            states.append(
                ReplicaState(
                    index=i,
                    base_url=url,
                    down_reason=down,
                    slots=book.slots,
                    # Requests without a named slot (one-slot servers, APIs that take no id_slot) occupy one too.
                    busy_slots=min(book.slots, max(sum(1 for s in range(book.slots) if book.taken(s)), in_flight)),
                    in_flight=in_flight,
                    sessions=(
                        placements.count_on(profile, i) + self.sessions_elsewhere.get(self.home(profile, i), 0)
                        if count_sessions
                        else 0
                    ),
                    # Never used: neither by this proxy nor, as the shared state said, by a session of another.
                    unused_slots=sum(1 for s in range(book.slots) if not book.taken(s) and s not in book.last_used),
                )
            )
        return states

    def started(self, profile: str, slot: int | None, session_id: str | None = None, replica: int = 0) -> None:
        self.in_flight[profile] = self.in_flight.get(profile, 0) + 1
        home = self.home(profile, replica)
        self.replica_in_flight[home] = self.replica_in_flight.get(home, 0) + 1
        if session_id is not None:
            _, count = self.sessions_in_flight.get(session_id, (profile, 0))
            self.sessions_in_flight[session_id] = (profile, count + 1)
        if slot is not None:
            book = self._books[(profile, replica)]
            book.busy[slot] = book.busy.get(slot, 0) + 1

    def ended(self, profile: str, slot: int | None, session_id: str | None, replica: int, used: bool = True) -> None:
        """`used`: False for a request never forwarded (its slot neither used nor its session's)."""
        self.in_flight[profile] = max(0, self.in_flight.get(profile, 0) - 1)
        home = self.home(profile, replica)
        self.replica_in_flight[home] = max(0, self.replica_in_flight.get(home, 0) - 1)
        if session_id is not None and session_id in self.sessions_in_flight:
            where, count = self.sessions_in_flight.pop(session_id)
            if count > 1:
                self.sessions_in_flight[session_id] = (where, count - 1)
        book = self._books[(profile, replica)]
        if slot is not None:
            book.busy[slot] = max(0, book.busy.get(slot, 0) - 1)
            if used:
                book.last_used[slot] = time.monotonic()
            elif session_id is not None and book.by_session.get(session_id) == slot:
                book.by_session.pop(session_id)

    def count(self, profile: str, replica: int, timings: Timings) -> None:
        counts = self.replica_counts.setdefault((profile, replica), {})
        counts["requests"] = counts.get("requests", 0) + 1
        for field in ("predicted_n", "draft_n", "draft_n_accepted"):
            counts[field] = counts.get(field, 0) + getattr(timings, field)

    def profile_states(
        self,
        replicas_of: Mapping[str, list[ReplicaState]],
        speculates: Callable[[str], bool],
        can_save: Callable[[str], bool],
        spec_types: Mapping[str, tuple[str, ...] | None],
    ) -> list[ProfileState]:
        """Each profile as decide() sees it: its healthy replicas' slots together (a pool is one bigger profile), its
        servers' load (on a server shared with other profiles, theirs counts too), and the requests decoding
        without speculation beside it."""
        names = self.health.names()
        homes = {n: self.home(n, 0) for n in names}
        shared = {h for h in homes.values() if sum(1 for other in homes.values() if other == h) > 1}
        plain_in_flight: dict[tuple[str, int], int] = {}
        for n in names:
            if not speculates(n):
                plain_in_flight[homes[n]] = plain_in_flight.get(homes[n], 0) + self.in_flight.get(n, 0)
        out = []
        for n in names:
            replicas = replicas_of[n]
            healthy = [r for r in replicas if r.down_reason is None] or replicas
            home = homes[n]
            out.append(
                ProfileState(
                    name=n,
                    down_reason=self.health.down_reason(n),
                    in_flight=sum(r.in_flight for r in replicas),
                    slots=sum(r.slots for r in healthy),
                    handoff=can_save(n),
                    draft_model=uses_draft_model(spec_types.get(n)),
                    speculates=speculates(n),
                    server=f"{home[0]}#{home[1]}" if home in shared else "",
                    plain_beside=plain_in_flight.get(home, 0),
                )
            )
        return out
