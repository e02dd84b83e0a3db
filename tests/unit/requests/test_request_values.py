"""A request's values: where it went (`Routed`) and why not (`Refusal`) say its profile, replica and pool, and what
one forward counted (`forward_counts`) follows from how it ended; each value is made once by its stage, the running
tallies written by their one owner, and no stage writes what is now a value."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

from adaptive_spec.llama.upstreams import Upstream
from adaptive_spec.requests.accounting import forward_counts
from adaptive_spec.requests.body.parse import ParsedRequest, split_path
from adaptive_spec.requests.body.values import Prepared, Received
from adaptive_spec.requests.forwarding.outcome import CLIENT_GONE, SERVED, Outcome
from adaptive_spec.requests.forwarding.sent import Forwards, Sent
from adaptive_spec.requests.gemini.request import GeminiCall
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


def test_a_value_made_by_its_stage_is_not_made_again() -> None:
    """`received`, `prepared`, `rewrite` and `refusal` are made once: a second write is a stage patching another's."""
    req = _request()
    req.received = Received(b"{}", GeminiCall("m", stream=False, sse=False, not_honoured=()))
    req.prepared = Prepared(ParsedRequest({}, False, None))
    req.refusal = Refusal(503, "busy", "busy")
    assert (req.body, req.gemini is not None) == (b"{}", True)
    for name, value in (("received", Received(b"[]")), ("prepared", req.prepared), ("refusal", req.refusal)):
        with pytest.raises(AttributeError, match="made once"):
            setattr(req, name, value)
    req.to = Routed(Upstream("pool", "http://a"), pool_size=2)
    req.to = Routed(Upstream("pool", "http://b", replica=1), pool_size=2)  # a failover's: one per forward
    assert req.replica == 1


@pytest.mark.parametrize("name", ["body", "gemini", "meter", "sent", "unseen", "last_progress"])
def test_what_a_stage_makes_is_no_field_of_the_request_to_write(name: str) -> None:
    """The body and Gemini call are the `Received` value; the meter, the body sent and the counts not seen are the
    sending stage's tally (`forwards`); the last progress is the lifecycle's: none is a field a stage can set."""
    req = _request()
    with pytest.raises(AttributeError):
        setattr(req, name, None)


def test_the_sending_stage_s_tally_is_its_last_forward_s() -> None:
    """Each forward begins with a meter of its own (a failed-over request is recorded as its last forward); the
    counts of answers not seen to their end are kept from every forward."""
    forwards, loop = Forwards(), asyncio.new_event_loop()
    try:
        first = forwards.begin(Sent(b"1"))
        unseen = loop.create_future()
        forwards.ended(unseen)
        second = forwards.begin(Sent(b"2", speculation={"n_max": 4}))
        forwards.ended(None)
        assert second is not first and forwards.meter is second
        assert forwards.sent == Sent(b"2", speculation={"n_max": 4}) and forwards.unseen == (unseen,)
    finally:
        loop.close()


SRC = Path(__file__).resolve().parents[3] / "src" / "adaptive_spec"
# Every statement in src/ that writes a request's field, by module and function: the stage that makes each value.
WRITES = {
    ("requests/handler.py", "_prepare", "received"),
    ("requests/handler.py", "_prepare", "prepared"),
    ("requests/handler.py", "_prepare", "rewrite"),
    ("requests/handler.py", "route", "refusal"),
    ("requests/handler.py", "_failover", "to"),  # where it went stays, its route completed, if it is refused now
    ("requests/handler.py", "_handle", "to"),
    ("requests/handler.py", "_forward_once", "forwards.begin"),  # the sending stage's tally: written by it alone
    ("requests/handler.py", "_forward_once", "forwards.ended"),
}


def _is_req(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "req"


def _writes(tree: ast.AST, module: str) -> set[tuple[str, str, str]]:
    """(module, function, field) for each assignment to `req.<field>` and each call that writes through one."""
    found: set[tuple[str, str, str]] = set()
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        name = func.name
        for node in ast.walk(func):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = [
                    t for target in node.targets for t in (target.elts if isinstance(target, ast.Tuple) else [target])
                ]
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
                targets = [node.target]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value  # req.<field>.<method>(…): a tally or a list written through
                through = node.func.attr in ("append", "extend", "begin", "ended", "clear", "update")
                if through and isinstance(owner, ast.Attribute) and _is_req(owner.value):
                    found.add((module, name, f"{owner.attr}.{node.func.attr}"))
            for t in targets:
                while isinstance(t, ast.Attribute) and isinstance(t.value, ast.Attribute):
                    t = t.value  # req.meter.live = …: a write of req.meter's
                if isinstance(t, ast.Attribute) and _is_req(t.value):
                    found.add((module, name, t.attr))
    return found


def test_only_the_stage_that_makes_a_value_writes_it() -> None:
    """No stage writes what another made, or what is now a value (`req.meter = …`, `req.sent = …` in the body's
    maker, `req.body = …` in the parse): each write is its stage's, at one site."""
    found: set[tuple[str, str, str]] = set()
    for path in sorted(SRC.rglob("*.py")):
        module = path.relative_to(SRC).as_posix()
        found |= _writes(ast.parse(path.read_text(encoding="utf-8")), module)
    assert found == WRITES
