"""A session's next turn on a one-slot server after something else used its slot: the estimate counts what the slot
and llama-server's RAM cache still hold of the session. Another request taking the slot over leaves the session's
prompt in the RAM cache (llama-server saves it there when a request selects the slot); a slot action (a head's
restore for another session, an erase) overwrites it, and nothing of the session is left."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from adaptive_spec.kv.heads.matching import HeadEntry, ServerKey, chain
from adaptive_spec.kv.heads.values import HeadsView, Restored
from adaptive_spec.kv.moves import HeadRestore
from adaptive_spec.llama.upstreams import Upstream, UpstreamTable
from adaptive_spec.routing.contract import Completion, Route
from adaptive_spec.routing.router import Router
from adaptive_spec.telemetry.records import Timings
from tests.support.routing import make_router, request

KEY = ServerKey("/models/qwen.gguf", 491_400_064, 8192, "t1")
URL = "http://127.0.0.1:9"
MAIN = "You are the main agent. Read before you edit. " * 200  # ~9,200 characters
CLASSIFIER = "Score how hard the request is, in JSON. " * 60  # ~2,400: a head worth restoring
REPLY = "I will write hello.py now."


def _router() -> Router:
    return make_router(UpstreamTable([Upstream("p", URL)]), {"p": 1}, {"p": ("none",)})


def _main(*turns: str) -> dict[str, object]:
    messages: list[dict[str, str]] = [{"role": "system", "content": MAIN}]
    for i, text in enumerate(turns):
        if i:
            messages.append({"role": "assistant", "content": REPLY})
        messages.append({"role": "user", "content": text})
    return {"messages": messages}


def _classifier(text: str) -> dict[str, object]:
    return {"messages": [{"role": "system", "content": CLASSIFIER}, {"role": "user", "content": text}]}


def _serve(r: Router, route: Route, prompt_n: int, cache_n: int = 0, reply: str = REPLY) -> None:
    r.complete(route, Completion(True, Timings(prompt_n=prompt_n, cache_n=cache_n, predicted_n=8), reply))


def _routed(r: Router, body: dict[str, object], session: str, **heads: HeadsView) -> Route:
    ask = request(body, session)
    route = r.route(replace(ask, heads={("p", 0): heads["view"]}) if heads else ask)
    assert isinstance(route, Route), route
    return route


def _head_view(r: Router) -> HeadsView:
    """The store's view of the server with a head of the classifier's prompt (its pieces as the router reads them)."""
    probe = _routed(r, _classifier("probe"), "probe")
    r.complete(probe, Completion(ok=False))
    links = chain(KEY, [p.digest for p in probe.pieces[:1]])
    head = HeadEntry(links[-1][:24], links, (probe.pieces[0].chars,), 600, 604, 10**6, 0.0, 0.0)
    return HeadsView(URL, KEY, "", (head,), {}, 400e6, any_prefix=False)


def _another_session_served(r: Router) -> None:
    _serve(r, _routed(r, _classifier("Create hello.py."), "classifier-1"), prompt_n=620)


def _a_head_restored_for_another_session(r: Router) -> None:
    view = _head_view(r)
    route = _routed(r, _classifier("Create hello.py."), "classifier-2", view=view)
    assert isinstance(route.move, HeadRestore), route.decision.reasons
    done = r.moved(route, Restored(view.entries[0].id, URL, tokens=600, restore_ms=20.0, pieces=1))
    _serve(r, done, prompt_n=20, cache_n=600)


def _the_slots_erased(r: Router) -> None:
    r.slots_erased("p")


# What happened to the one slot between the main conversation's turns, and what its next turn prefills: its new
# messages (its prompt in the RAM cache), or all of it.
CASES: list[tuple[str, Callable[[Router], None], bool]] = [
    ("nothing", lambda r: None, False),
    ("another session's request took the slot", _another_session_served, False),
    ("a head restored into it for another session", _a_head_restored_for_another_session, True),
    ("the server's slots erased", _the_slots_erased, True),
]


@pytest.mark.parametrize(("between", "event", "all_of_it"), CASES, ids=[c[0] for c in CASES])
def test_the_next_turn_prefills_what_the_server_no_longer_holds(
    between: str, event: Callable[[Router], None], all_of_it: bool
) -> None:
    r = _router()
    first = _routed(r, _main("Create hello.py."), "main")
    _serve(r, first, prompt_n=2300)
    event(r)
    second = _routed(r, _main("Create hello.py.", "Now make it print bye."), "main")
    new_tokens = second.decision.new_tokens
    assert new_tokens is not None
    if all_of_it:
        assert new_tokens > 2200, (between, second.decision.reasons)
    else:
        assert new_tokens < 60, (between, second.decision.reasons)


# A new session's first request on the one slot, after the main conversation took the slot over from an earlier
# request under the same system prompt: llama-server saved that one to its RAM cache and loads it back when the new
# prompt keeps a quarter of it or more (`server_prompt_cache::load`), so the new session prefills what follows.
RAM_CASES = [
    # (what, the earlier request's user text, prompt_n it was served with, new tokens at most, at least)
    ("the classifier again as a new session", "Create hello.py.", 620, 60, 1),
    ("a prompt keeping under a quarter of it", "Create hello.py. " + "Read the files first. " * 400, 3000, 10**6, 600),
]


@pytest.mark.parametrize(("case", "earlier", "prompt_n", "most", "least"), RAM_CASES, ids=[c[0] for c in RAM_CASES])
def test_a_new_session_finds_another_sessions_prompt_in_the_ram_cache(
    case: str, earlier: str, prompt_n: int, most: int, least: int
) -> None:
    r = _router()
    _serve(r, _routed(r, _classifier(earlier), "classifier-1"), prompt_n=prompt_n)
    _serve(r, _routed(r, _main("Create hello.py."), "main"), prompt_n=2300)  # takes the slot over
    new_tokens = _routed(r, _classifier("Now make it print bye."), "classifier-2").decision.new_tokens
    assert new_tokens is not None and least <= new_tokens <= most, (case, new_tokens)
