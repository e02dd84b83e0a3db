"""The head store's tables (`kv/heads/tables.py`): what a route sees of a server, the heads slots hold,
first requests, and its verdicts, all synchronous (no file, no HTTP)."""

from __future__ import annotations

import pytest

from adaptive_spec.kv.heads.activity import INERT_HEAD_S, Verdict
from adaptive_spec.kv.heads.matching import HeadEntry, ServerKey, chain
from adaptive_spec.kv.heads.tables import HeadTables
from adaptive_spec.kv.heads.values import Restored

KEY = ServerKey("/models/qwen.gguf", 491_400_064, 8192, "t1")
A, B = "http://a", "http://b"


def _entry(piece: bytes) -> HeadEntry:
    links = chain(KEY, [piece])
    return HeadEntry(links[-1][:24], links, (400,), 1000, 1004, 10**6, 0.0, 0.0)


def _view(
    tables: HeadTables, server: str = A, *entries: HeadEntry, now: float = 0.0
) -> tuple[dict[int, str], list[str]]:
    seen = tables.view(server, KEY, "", entries or (_entry(b"one"), _entry(b"two")), 400e6, False, now)
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
    tables = HeadTables()
    for step, server, slot, head in steps:
        if step == "hold":
            tables.hold(server, slot, Restored(head, server, 1000, 0.0, forwards=tables.forwarded_to(server)))
        elif step == "forwarded":
            tables.forwarded(server, slot)
        elif step == "emptied":
            tables.emptied(server)
        else:
            tables.restarted(server)
    assert _view(tables)[0] == held
    for slot, head in held.items():
        assert tables.holds(A, slot, head) is not None and tables.holds(A, slot, "other") is None


def test_a_head_whose_restore_was_inert_is_not_shown_on_that_server_for_an_hour() -> None:
    tables, one, two = HeadTables(), _entry(b"one"), _entry(b"two")
    tables.reused(A)  # the server restores: an inert restore is that head's fault alone
    tables.forwarded(A, 0)
    verdict, _ = tables.judge(A, Restored(one.id, A, 1000, 5.0, forwards=0), "", now=10.0)
    assert verdict is Verdict.HEAD
    assert _view(tables, A, one, two, now=11.0)[1] == [two.id]
    assert _view(tables, B, one, two, now=11.0)[1] == [one.id, two.id]  # on another server it is
    assert _view(tables, A, one, two, now=10.0 + INERT_HEAD_S)[1] == [one.id, two.id]
    assert not tables.paused(A, 11.0)


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
    tables = HeadTables()
    for where in seen:
        tables.arriving("", "s", where)
    for _ in range(restarts):
        tables.restarted(server)
    assert tables.would_arrive("", "s", server) == arriving
    assert tables.would_arrive("", "s", server) == arriving  # asking counts nothing
    assert tables.arriving("", "s", server) == arriving
    assert not tables.arriving("", "s", server)  # and now it is seen
    assert tables.would_arrive("other-tenant", "s", server)  # one tenant's session of a name is not another's


def test_a_first_request_ends_once_with_what_was_restored_for_it() -> None:
    tables = HeadTables()
    restored = Restored("h1", A, 1000, 5.0)
    tables.begin("r1", restored)
    tables.begin("r2", None)
    assert tables.end("r1") == (True, restored) and tables.end("r1") == (False, None)
    assert tables.end("r2") == (True, None) and tables.end("r3") == (False, None)


def test_a_verdict_another_proxy_heard_keeps_that_head_off_that_server() -> None:
    tables, one, two = HeadTables(), _entry(b"one"), _entry(b"two")
    tables.heard_inert(A, one.id, until=100.0, server_until=None)
    assert _view(tables, A, one, two, now=50.0)[1] == [two.id]
    assert _view(tables, B, one, two, now=50.0)[1] == [one.id, two.id]
    assert _view(tables, A, one, two, now=100.0)[1] == [one.id, two.id]  # it lapses as the teller's does
    assert not tables.paused(A, 50.0)
    tables.heard_inert(A, two.id, until=700.0, server_until=600.0)
    assert tables.paused(A, 500.0) and not tables.paused(A, 600.0)
