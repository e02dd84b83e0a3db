"""A head restore is the router's move like a handoff: `route()` decides it from what the head store showed
(`RouteRequest.heads`), its estimate counts it from the start, and `moved()` hears what the store did."""

from __future__ import annotations

from dataclasses import replace

from adaptive_spec.kv.heads.matching import HeadEntry, ServerKey, chain
from adaptive_spec.kv.heads.values import HeadsView, Restored
from adaptive_spec.kv.moves import HeadRestore
from adaptive_spec.llama.upstreams import Upstream, UpstreamTable
from adaptive_spec.routing.contract import Completion, Route, RouteRequest
from adaptive_spec.routing.router import Router
from adaptive_spec.telemetry.records import Timings
from tests.support.routing import make_router, request

KEY = ServerKey("/models/qwen.gguf", 491_400_064, 8192, "t1")
SYSTEM = "You are a coding agent. " * 400  # ~9,600 characters: a head worth restoring
URL = "http://127.0.0.1:9"


def _router() -> Router:
    table = UpstreamTable([Upstream("p", URL)])
    return make_router(table, {"p": 1}, {"p": ("none",)})


def _body(user: str, system: str = SYSTEM) -> dict[str, object]:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def _routed(r: Router, ask: RouteRequest) -> Route:
    route = r.route(ask)
    assert isinstance(route, Route), route
    return route


def _view(r: Router, body: dict[str, object], tokens: int = 2400) -> HeadsView:
    """The store's view of the server, holding a head of `body`'s prompt (its pieces' digests as the router reads
    them: a request routed and given up)."""
    probe = _routed(r, request(body, "probe"))
    r.complete(probe, Completion(ok=False))
    links = chain(KEY, [p.digest for p in probe.pieces])
    head = HeadEntry(links[-1][:24], links, tuple(p.chars for p in probe.pieces), tokens, tokens + 4, 10**6, 0.0, 0.0)
    return HeadsView(URL, KEY, "", (head,), {}, 400e6, any_prefix=False)


def test_a_sessions_first_request_is_routed_with_the_restore_and_estimated_as_what_it_prefills() -> None:
    r = _router()
    body = _body("Write hello.py.")
    view = _view(r, body)
    cold = _routed(r, request(body, "cold"))  # the same prompt, no view: nothing to restore
    r.complete(cold, Completion(ok=False))
    assert cold.move is None and cold.decision.new_tokens is not None and cold.decision.new_tokens > 2000
    warm = _routed(r, replace(request(body, "warm"), heads={("p", 0): view}))
    assert isinstance(warm.move, HeadRestore) and warm.move.match.pieces == len(warm.pieces), warm.move
    assert warm.decision.new_tokens is not None and warm.decision.new_tokens < 50, warm.decision
    assert warm.decision.reasons[-1] == "warm: head of 2400 tokens to restore"

    restored = Restored(view.entries[0].id, URL, tokens=2400, restore_ms=12.0, pieces=len(warm.pieces))
    done = r.moved(warm, restored)
    assert done.restored == restored and done.decision.new_tokens == warm.decision.new_tokens
    assert done.decision.reasons == (*warm.decision.reasons[:-1], restored.reason())

    given_up = r.moved(warm, None)  # a busy slot, the store's lock: the request prefills it all
    assert given_up.restored is None and given_up.decision.new_tokens == cold.decision.new_tokens
    assert given_up.decision.reasons == warm.decision.reasons[:-1]


def test_no_restore_for_a_side_request_or_where_the_store_showed_nothing() -> None:
    r = _router()
    body = _body("Write hello.py.")
    view = _view(r, body)
    first = _routed(r, request(body, "s"))
    r.complete(first, Completion(True, Timings(prompt_n=2450, predicted_n=10, predicted_ms=100.0)))
    side = _routed(r, replace(request(_body("Write a title.", "Title this."), "s"), heads={("p", 0): view}))
    assert side.decision.side and side.move is None, side
    r.complete(side, Completion(ok=False))
    other_server = _routed(r, replace(request(body, "t"), heads={("q", 0): view}))
    assert other_server.move is None
