from __future__ import annotations

from adaptive_spec.telemetry.ledger import COUNTERS, Counts, Ledger, Settled, busy, from_metrics

S = "http://server"


def _reading(ledger: Ledger, counters: Counts) -> Settled | None:
    started_at = ledger.quiet(S)
    assert started_at is not None
    return ledger.read(S, started_at, counters)


def test_one_unseen_request_is_given_what_llama_server_counted_beyond_the_seen_ones() -> None:
    ledger = Ledger()
    assert _reading(ledger, Counts(100, 0, 10)) == Settled((), None)  # the baseline
    ledger.forwarded(S)
    assert not ledger.ended(S, "seen", Counts(20, 5, 4, 3, 2))
    ledger.forwarded(S)
    assert ledger.ended(S, "hung", None)  # held: its counts wait for the next reading
    assert ledger.waiting(S)
    settled = _reading(ledger, Counts(150, 12, 30, 3, 2))
    assert settled == Settled(("hung",), Counts(30, 7, 16, 0, 0))
    assert not ledger.waiting(S)


def test_two_unseen_requests_cannot_be_told_apart_and_a_reading_across_a_forward_is_dropped() -> None:
    ledger = Ledger()
    _reading(ledger, Counts())
    for rid in ("a", "b"):
        ledger.forwarded(S)
        ledger.ended(S, rid, None)
    started_at = ledger.quiet(S)
    assert started_at is not None
    ledger.forwarded(S)  # a request went out while /metrics was read
    assert ledger.quiet(S) is None
    assert ledger.read(S, started_at, Counts(9)) is None
    ledger.ended(S, "c", Counts(1))
    assert _reading(ledger, Counts(10)) == Settled(("a", "b"), None)


def test_without_a_baseline_nothing_is_held_and_traffic_beside_the_proxy_is_told() -> None:
    ledger = Ledger()
    ledger.forwarded(S)
    assert not ledger.ended(S, "hung", None)  # nothing to compare with
    _reading(ledger, Counts(10))
    assert _reading(ledger, Counts(15)) == Settled((), None, Counts(5))  # another client of the server


def test_a_difference_below_zero_is_not_given_to_anyone() -> None:
    ledger = Ledger()
    _reading(ledger, Counts(10))
    ledger.forwarded(S)
    ledger.ended(S, "hung", None)
    assert _reading(ledger, Counts(5)) == Settled(("hung",), None)  # the server restarted: its counters reset


def test_llama_servers_counters_are_read_from_its_metrics() -> None:
    values = {name: 2.0 for name in COUNTERS.values()}
    assert from_metrics(values) == Counts(2, 2, 2, 2, 2, 2000.0, 2000.0)
    assert from_metrics({}) is None
    assert busy({"llamacpp:requests_processing": 1.0}) and not busy({"llamacpp:requests_deferred": 0.0})


def test_an_answer_whose_usage_does_not_add_up_is_not_given_another_clients_work() -> None:
    """A client beside the proxy (a test, a script on llama-server's own port) makes the difference more than the
    unseen request did: its usage tells, nothing is given, and the server is known to be shared from then on."""
    ledger = Ledger()
    _reading(ledger, Counts())
    ledger.forwarded(S)
    assert ledger.ended(S, "usage-only", None, known=Counts(10, 5, 8))
    assert _reading(ledger, Counts(10, 5, 8, 6, 4)) == Settled(("usage-only",), Counts(10, 5, 8, 6, 4))  # adds up
    ledger.forwarded(S)
    ledger.ended(S, "usage-only-2", None, known=Counts(10, 5, 8))
    settled = _reading(ledger, Counts(10 + 30, 5 + 5, 8 + 20, 6, 4))  # another client's prompt counted too
    assert settled == Settled(("usage-only-2",), None)
    ledger.forwarded(S)
    assert not ledger.ended(S, "hung", None)  # on a shared server a cut answer cannot be checked: not held
