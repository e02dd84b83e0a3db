"""A request's values: where it went (`Routed`) and why not (`Refusal`) say its profile, replica and pool, and what
one forward counted (`forward_counts`) follows from how it ended."""

from __future__ import annotations

from adaptive_spec.llama.upstreams import Upstream
from adaptive_spec.requests.accounting import forward_counts
from adaptive_spec.requests.body.parse import split_path
from adaptive_spec.requests.forwarding.outcome import CLIENT_GONE, SERVED, Outcome
from adaptive_spec.requests.lifecycle import ProxyRequest, Routed
from adaptive_spec.routing.contract import Refusal
from adaptive_spec.routing.decision import Choice, compose
from adaptive_spec.streams.meter import ResponseMeter
from adaptive_spec.telemetry.ledger import Counts

CHOICE = Choice("iterative", "estimate", ("iterative: est 2.4x",), 0.7, 9000)


def _request() -> ProxyRequest:
    return ProxyRequest("r1", split_path("/v1/chat/completions"), "plain")


def test_a_request_not_routed_is_its_named_profile_s_first_server() -> None:
    req = _request()
    assert (req.profile, req.replica, req.pool_size, req.route, req.decision) == ("plain", 0, 1, None, None)


def test_where_a_request_went_says_its_profile_replica_and_pool() -> None:
    req = _request()
    req.to = Routed(Upstream("pool", "http://b", replica=1), pool_size=2)
    assert (req.profile, req.replica, req.pool_size) == ("pool", 1, 2)


def test_a_refusal_names_the_profile_its_decision_chose() -> None:
    req = _request()
    req.refusal = Refusal(503, "busy", "busy", compose(CHOICE))
    assert (req.profile, req.decision) == ("iterative", compose(CHOICE))


def test_a_failover_refused_keeps_the_server_it_went_to() -> None:
    """The route completed on a failed replica, then refused without a decision: the record still says where it
    went (the profile and replica the request was sent to)."""
    req = _request()
    req.to = Routed(Upstream("pool", "http://b", replica=1), pool_size=2)
    req.refusal = Refusal(503, "every replica is down", "profile_unavailable")
    assert (req.profile, req.replica, req.pool_size) == ("pool", 1, 2)


def test_a_forward_s_counts_follow_how_it_ended() -> None:
    meter = ResponseMeter()
    assert forward_counts(False, meter, None) == Counts()  # not generating: nothing to count
    assert forward_counts(True, meter, Outcome(400, "bad", "invalid_request")) == Counts()  # refused before any work
    assert forward_counts(True, meter, CLIENT_GONE) is None  # it may have worked: the ledger says
    assert forward_counts(True, meter, None) is None  # ended by an exception
    assert forward_counts(True, meter, SERVED) is None  # served, but its answer showed no counts
    cut = Outcome(502, "the stream was cut")
    assert forward_counts(True, meter, cut) == Counts()  # nothing reached the client: no work was done
    meter._pieces = 3
    assert forward_counts(True, meter, cut) is None  # some of the answer went out: the ledger says the rest
