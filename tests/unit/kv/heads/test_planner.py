"""The head store's planner (`kv/heads/planner.py`) as tables: what a route sees of a server, the heads slots hold,
first requests, and its verdicts, all synchronous (no file, no HTTP)."""

from __future__ import annotations

import pytest

from adaptive_spec.kv.heads.activity import INERT_HEAD_S, Verdict
from adaptive_spec.kv.heads.matching import HeadEntry, ServerKey, chain
from adaptive_spec.kv.heads.planner import HeadPlanner
from adaptive_spec.kv.heads.values import Restored

KEY = ServerKey("/models/qwen.gguf", 491_400_064, 8192, "t1")
A, B = "http://a", "http://b"


def _entry(piece: bytes) -> HeadEntry:
    links = chain(KEY, [piece])
    return HeadEntry(links[-1][:24], links, (400,), 1000, 1004, 10**6, 0.0, 0.0)


def _view(
    planner: HeadPlanner, server: str = A, *entries: HeadEntry, now: float = 0.0
) -> tuple[dict[int, str], list[str]]:
    seen = planner.view(server, KEY, "", entries or (_entry(b"one"), _entry(b"two")), 400e6, False, now)
    return {slot: h.head for slot, h in seen.held.items()}, [e.id for e in seen.entries]


@pytest.mark.parametrize(
    ("steps", "held"),
    [
        ([], {}),
        ([("hold", A, 0, "h1")], {0: "h1"}),
        ([("hold", A, 0, "h1"), ("hold", A, 1, "h2")], {0: "h1", 1: "h2"}),
        ([("hold", B, 0, "h1")], {}),  # another server's slot
        ([("hold", A, 0, "h1"), ("forwarded", A, 1, "")], {}),  # a request came to the server since
        ([("forwarded", A, 1, ""), ("hold", A, 0, "h1")], {0: "h1"}),  # one before it does not count
        ([("hold", A, 0, "h1"), ("forwarded", B, 0, "")], {0: "h1"}),
        ([("hold", A, 0, "h1"), ("emptied", A, 0, "")], {}),
        ([("hold", A, 0, "h1"), ("restarted", A, 0, "")], {}),
    ],
)
def test_a_route_sees_the_heads_slots_hold_untouched(
    steps: list[tuple[str, str, int, str]], held: dict[int, str]
) -> None:
    planner = HeadPlanner()
    for step, server, slot, head in steps:
        if step == "hold":
            planner.hold(server, slot, Restored(head, server, 1000, 0.0, forwards=planner.forwarded_to(server)))
        elif step == "forwarded":
            planner.forwarded(server, slot)
        elif step == "emptied":
            planner.emptied(server)
        else:
            planner.restarted(server)
    assert _view(planner)[0] == held
    for slot, head in held.items():
        assert planner.holds(A, slot, head) is not None and planner.holds(A, slot, "other") is None


def test_a_head_whose_restore_was_inert_is_not_shown_on_that_server_for_an_hour() -> None:
    planner, one, two = HeadPlanner(), _entry(b"one"), _entry(b"two")
    planner.reused(A)  # the server restores: an inert restore is that head's fault alone
    planner.forwarded(A, 0)
    verdict, _ = planner.judge(A, Restored(one.id, A, 1000, 5.0, forwards=0), "", now=10.0)
    assert verdict is Verdict.HEAD
    assert _view(planner, A, one, two, now=11.0)[1] == [two.id]
    assert _view(planner, B, one, two, now=11.0)[1] == [one.id, two.id]  # on another server it is
    assert _view(planner, A, one, two, now=10.0 + INERT_HEAD_S)[1] == [one.id, two.id]
    assert not planner.paused(A, 11.0)


@pytest.mark.parametrize(
    ("seen", "server", "restarts", "arriving"),
    [
        ([], A, 0, True),  # the first request the store sees of it
        ([A], A, 0, False),
        ([A], A, 1, True),  # its first since its server restarted
        ([A], B, 0, False),  # seen on another server: its KV is not lost
        ([A], B, 1, False),
    ],
)
def test_a_sessions_first_request_on_a_server_arrives_once(
    seen: list[str], server: str, restarts: int, arriving: bool
) -> None:
    planner = HeadPlanner()
    for where in seen:
        planner.arriving("", "s", where)
    for _ in range(restarts):
        planner.restarted(server)
    assert planner.would_arrive("", "s", server) == arriving
    assert planner.would_arrive("", "s", server) == arriving  # asking counts nothing
    assert planner.arriving("", "s", server) == arriving
    assert not planner.arriving("", "s", server)  # and now it is seen
    assert planner.would_arrive("other-tenant", "s", server)  # one tenant's session of a name is not another's


def test_a_first_request_ends_once_with_what_was_restored_for_it() -> None:
    planner = HeadPlanner()
    restored = Restored("h1", A, 1000, 5.0)
    planner.begin("r1", restored)
    planner.begin("r2", None)
    assert planner.end("r1") == (True, restored) and planner.end("r1") == (False, None)
    assert planner.end("r2") == (True, None) and planner.end("r3") == (False, None)
