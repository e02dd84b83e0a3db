"""The head store's counts of each server's traffic (kv/heads/activity.py): marks, restarts, and inert restores."""

from __future__ import annotations

from adaptive_spec.kv.heads.activity import (
    INERT_HEAD_S,
    INERT_SERVER_S,
    INERT_STRIKES,
    Counted,
    ServerActivity,
    Verdict,
    alone_after,
)

A, B = "http://a", "http://b"


def test_a_mark_counts_what_could_have_used_a_slot() -> None:
    seen = ServerActivity()
    seen.forwarded(A, None, "r1")
    seen.forwarded(A, 1, "r2")
    seen.forwarded(A, 0, None)
    seen.forwarded(B, 1, None)
    # r1 named no slot: every request to A counts; r2 named slot 1: the unpinned ones and slot 1's.
    assert seen.mark_of("r1") == (1, 0) and seen.mark_of("r2") == (1, 1)
    assert seen.mark_of("r1") is None  # taken once
    assert seen.mark(A, None) == (3, 0) and seen.mark(A, 1) == (1, 1) and seen.mark(A, 0) == (1, 1)
    assert seen.forwarded_to(A) == 3 and seen.forwarded_to(B) == 1


def test_a_session_arrives_once_and_again_after_its_server_restarted() -> None:
    seen = ServerActivity()
    assert seen.arriving(("", "s"), A)
    assert not seen.arriving(("", "s"), A)
    seen.restarted(B)
    assert not seen.arriving(("", "s"), A)  # another server's restart: its KV is where it was
    seen.restarted(A)
    assert seen.arriving(("", "s"), A) and not seen.arriving(("", "s"), A)


def test_restores_pause_after_inert_heads_in_a_row_unless_another_request_came_between() -> None:
    seen = ServerActivity()
    seen.forwarded(A, None, None)
    at_restore = seen.forwarded_to(A)
    seen.forwarded(A, None, None)  # the restore's own request
    seen.forwarded(A, None, None)  # and another one: it may have taken the slot
    assert seen.judge(A, at_restore, "h0") == (Verdict.TAKEN, 0)
    assert not seen.is_inert(A, 0.0) and not seen.head_inert(A, "h0", 0.0)
    for _ in range(3):  # one head judged again and again is one head: restores do not pause for it
        at_restore = seen.forwarded_to(A)
        seen.forwarded(A, None, None)
        assert seen.judge(A, at_restore, "h1") == (Verdict.STRIKE, 1)
    assert seen.head_inert(A, "h1", 1.0) and not seen.is_inert(A, 1.0)
    at_restore = seen.forwarded_to(A)
    seen.forwarded(A, None, None)
    assert seen.judge(A, at_restore, "h2", now=10.0) == (Verdict.INERT, INERT_STRIKES)
    assert seen.is_inert(A, 11.0) and not seen.is_inert(B, 11.0)
    # Verdicts expire: restores are tried again on the server, then the head itself.
    assert not seen.is_inert(A, 10.0 + INERT_SERVER_S) and seen.head_inert(A, "h2", 10.0 + INERT_SERVER_S)
    assert not seen.head_inert(A, "h2", 10.0 + INERT_HEAD_S)


def test_with_tenants_one_tenants_heads_alone_never_pause_restores_for_the_others() -> None:
    seen = ServerActivity()
    for n in range(4):  # team-a's own heads, each inert (a whitespace variant of each, say)
        at_restore = seen.forwarded_to(A)
        seen.forwarded(A, None, None)
        assert seen.judge(A, at_restore, f"a{n}", "team-a", tenants=True)[0] is Verdict.STRIKE
    assert not seen.is_inert(A, 0.0) and not seen.head_inert(A, "b0", 0.0)
    at_restore = seen.forwarded_to(A)
    seen.forwarded(A, None, None)
    assert seen.judge(A, at_restore, "b0", "team-b", tenants=True)[0] is Verdict.INERT  # two tenants: the server's
    assert seen.is_inert(A, 0.0)


def test_a_reused_restore_clears_the_strikes() -> None:
    seen = ServerActivity()
    at_restore = seen.forwarded_to(A)
    seen.forwarded(A, None, None)
    assert seen.judge(A, at_restore, "h0") == (Verdict.STRIKE, 1)
    seen.reused(A)
    assert A not in seen.strikes
    at_restore = seen.forwarded_to(A)
    seen.forwarded(A, None, None)
    # The server is known to restore now: an inert restore there is the head's, not the server's.
    assert seen.judge(A, at_restore, "h") == (Verdict.HEAD, 0) and not seen.is_inert(A, 0.0)


def test_on_a_server_that_has_reused_restores_an_inert_one_stops_that_head_alone() -> None:
    """One client's prompts that match a head but not its tokens (a whitespace variant) cannot switch restores off
    for everyone on a server known to restore; on a server that never reused one (a stock build that restores
    nothing) inert heads in a row still pause them (for a while)."""
    seen = ServerActivity()
    seen.reused(A)
    for _ in range(INERT_STRIKES + 1):
        at_restore = seen.forwarded_to(A)
        seen.forwarded(A, None, None)
        assert seen.judge(A, at_restore, "h1") == (Verdict.HEAD, 0)
    assert not seen.is_inert(A, 0.0) and seen.head_inert(A, "h1", 0.0) and not seen.head_inert(A, "h2", 0.0)
    for strike in range(1, INERT_STRIKES + 1):
        at_restore = seen.forwarded_to(B)
        seen.forwarded(B, None, None)
        assert seen.judge(B, at_restore, f"h{strike}")[1] == strike
    assert seen.is_inert(B, 0.0)


def test_shared_counts_are_unchanged_only_where_nothing_could_have_used_the_slot() -> None:
    mark = Counted("e", forwards=5, unnamed=1, slot=2, in_slot=3)
    other_slot = Counted("e", forwards=6, unnamed=1, slot=2, in_slot=3)  # a request to another slot came since
    assert mark.unchanged(mark, 2) and mark.unchanged(other_slot, 2)
    assert not mark.unchanged(other_slot, None)  # no slot known: every request counts
    assert not mark.unchanged(Counted("e", 6, 2, 2, 3), 2)  # one that named no slot
    assert not mark.unchanged(Counted("e", 6, 1, 2, 4), 2)  # one that named this slot
    assert not mark.unchanged(Counted("f", 5, 1, 2, 3), 2)  # a flushed store counts the same again
    assert not mark.unchanged(None, 2)  # unreadable
    assert not Counted("e", 5, 1, 2, 3, contested=True).unchanged(mark, 2)  # another proxy's could still come
    assert not mark.unchanged(Counted("e", 6, 1, 1, 3), 1)  # counted for another slot: every request counts


def test_a_restore_is_blamed_only_when_no_request_was_counted_since_its_own_booking() -> None:
    booked = Counted("e", forwards=5, unnamed=0, slot=0, in_slot=5)
    assert alone_after(booked, Counted("e", 5, 0, 0, 5))
    assert not alone_after(booked, Counted("e", 6, 0, 1, 1))  # another request, even to another slot
    assert not alone_after(booked, Counted("f", 5, 0, 0, 5))
    assert not alone_after(None, booked) and not alone_after(booked, None)
    assert not alone_after(Counted("e", 5, 0, 0, 5, contested=True), booked)
