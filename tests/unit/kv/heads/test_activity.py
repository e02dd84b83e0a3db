"""The head store's counts of each server's traffic (kv/heads/activity.py): marks, restarts, and inert restores."""

from __future__ import annotations

from adaptive_spec.kv.heads.activity import INERT_STRIKES, ServerActivity, Verdict

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


def test_restores_stop_after_inert_strikes_in_a_row_unless_another_request_came_between() -> None:
    seen = ServerActivity()
    seen.forwarded(A, None, None)
    at_restore = seen.forwarded_to(A)
    seen.forwarded(A, None, None)  # the restore's own request
    seen.forwarded(A, None, None)  # and another one: it may have taken the slot
    assert seen.judge(A, at_restore) == (Verdict.TAKEN, 0)
    assert A not in seen.inert
    for strike in range(1, INERT_STRIKES + 1):
        at_restore = seen.forwarded_to(A)
        seen.forwarded(A, None, None)
        verdict, strikes = seen.judge(A, at_restore)
        assert strikes == strike and verdict == (Verdict.INERT if strike == INERT_STRIKES else Verdict.STRIKE)
    assert A in seen.inert and B not in seen.inert
    seen.reused(B)  # a reused restore elsewhere starts nothing again here
    assert seen.strikes[A] == INERT_STRIKES


def test_a_reused_restore_clears_the_strikes() -> None:
    seen = ServerActivity()
    at_restore = seen.forwarded_to(A)
    seen.forwarded(A, None, None)
    assert seen.judge(A, at_restore) == (Verdict.STRIKE, 1)
    seen.reused(A)
    assert A not in seen.strikes
    at_restore = seen.forwarded_to(A)
    seen.forwarded(A, None, None)
    # The server is known to restore now: an inert restore there is the head's, not the server's.
    assert seen.judge(A, at_restore, "h") == (Verdict.HEAD, 0) and A not in seen.inert


def test_on_a_server_that_has_reused_restores_an_inert_one_stops_that_head_alone() -> None:
    """One client's prompts that match a head but not its tokens (a whitespace variant) cannot switch restores off
    for everyone on a server known to restore; on a server that never reused one (a stock build that restores
    nothing) the strikes still stop them all."""
    seen = ServerActivity()
    seen.reused(A)
    for _ in range(INERT_STRIKES + 1):
        at_restore = seen.forwarded_to(A)
        seen.forwarded(A, None, None)
        assert seen.judge(A, at_restore, "h1") == (Verdict.HEAD, 0)
    assert A not in seen.inert and (A, "h1") in seen.inert_heads and (A, "h2") not in seen.inert_heads
    for strike in range(1, INERT_STRIKES + 1):
        at_restore = seen.forwarded_to(B)
        seen.forwarded(B, None, None)
        assert seen.judge(B, at_restore, f"h{strike}")[1] == strike
    assert B in seen.inert
