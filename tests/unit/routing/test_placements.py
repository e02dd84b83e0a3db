"""Placements: which sessions' KV is in which slot, kept by an index instead of a scan of every session."""

from __future__ import annotations

import random
from dataclasses import replace

from adaptive_spec.routing.placements import Placement, Placements


class _Scan:
    """The reference: every session looked at on each displacement (what the index replaces)."""

    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self.by_session: dict[str, Placement] = {}

    def served(self, sid: str, profile: str, slot: int | None, cached: int, out: int, replica: int) -> None:
        old = self.by_session.pop(sid, None)
        turns = old.turns_here + 1 if old is not None and old.profile == profile else 1
        output = float(out) if old is None else 0.5 * out + 0.5 * old.output_tokens
        self.by_session[sid] = Placement(profile, slot, cached, turns, output, replica=replica)
        while len(self.by_session) > self.max_sessions:
            del self.by_session[next(iter(self.by_session))]

    def displace(self, profile: str, slot: int | None, keep: str | None, replica: int) -> None:
        for sid, p in self.by_session.items():
            if sid != keep and p.in_slot and (p.profile, p.slot, p.replica) == (profile, slot, replica):
                self.by_session[sid] = replace(p, in_slot=False)


def test_the_slot_index_displaces_exactly_what_a_scan_would() -> None:
    rng = random.Random(3)
    for _ in range(30):
        placements, scan = Placements(max_sessions=6), _Scan(6)
        for _ in range(300):
            sid, profile = f"s{rng.randrange(10)}", rng.choice(["oneshot", "iterative"])
            slot, replica = rng.choice([None, 0, 1]), rng.randrange(2)
            if rng.random() < 0.6:
                cached, out = rng.randrange(1000), rng.randrange(100)
                placements.served(sid, profile, slot, cached, out, replica)
                scan.served(sid, profile, slot, cached, out, replica)
            keep = sid if rng.random() < 0.8 else None
            placements.displace(profile, slot, keep, replica)
            scan.displace(profile, slot, keep, replica)
            assert dict(placements.items()) == scan.by_session
