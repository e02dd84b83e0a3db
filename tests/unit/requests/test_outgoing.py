"""Where a request is sent: its own path and query (a Gemini client's `?key=` taken out, however it is spelled), or
the chat completions path a Gemini body was translated for, without the client's query; and what it is sent as, a
value the request is given (`Sent`), never written into the request by the helper that makes it."""

from __future__ import annotations

import dataclasses

import orjson
import pytest
from aiohttp.test_utils import make_mocked_request

from adaptive_spec.llama.speculation import Speculation
from adaptive_spec.llama.upstreams import Upstream
from adaptive_spec.requests.body.parse import ParsedRequest, RoutedPath
from adaptive_spec.requests.body.values import Prepared, Received
from adaptive_spec.requests.forwarding.sent import Sent
from adaptive_spec.requests.lifecycle import ProxyRequest
from adaptive_spec.requests.outgoing import upstream_body, upstream_path, upstream_target
from adaptive_spec.requests.paths import decide_path

PLAIN = Upstream("plain", "http://127.0.0.1:9")
ROUTER = Upstream("plain", "http://127.0.0.1:9", upstream_model="qwen")


@pytest.mark.parametrize(
    ("method", "target", "upstream", "sent"),
    [
        ("GET", "/slots?fields=id", PLAIN, "/slots?fields=id"),
        ("GET", "/slots?key=sk-1&fields=id", PLAIN, "/slots?fields=id"),
        ("GET", "/props?%6Bey=sk-1", PLAIN, "/props"),
        ("GET", "/props?a=1&&b=2", PLAIN, "/props?a=1&&b=2"),  # nothing to take out: the query as sent
        ("GET", "/props?key=sk-1&model=other", ROUTER, "/props?model=qwen"),
        ("POST", "/v1/chat/completions?key=sk-1", PLAIN, "/v1/chat/completions"),
        (
            "POST",
            "/p/gem/v1beta/models/gemini-3.1-pro-preview:streamGenerateContent?alt=sse&key=sk-1",
            PLAIN,
            "/v1/chat/completions",
        ),
        ("POST", "/v1beta/models/gemini-3.5-flash-lite:generateContent", ROUTER, "/v1/chat/completions"),
    ],
)
def test_the_upstream_target_never_carries_the_clients_key(
    method: str, target: str, upstream: Upstream, sent: str
) -> None:
    request = make_mocked_request(method, target)
    routed = decide_path(request.raw_path)
    assert isinstance(routed, RoutedPath)
    assert upstream_target(request, upstream, routed) == sent
    assert upstream_path(routed) == sent.partition("?")[0]


def _chat(body: dict[str, object]) -> ProxyRequest:
    routed = decide_path("/v1/chat/completions")
    assert isinstance(routed, RoutedPath)
    raw = orjson.dumps(body)
    parsed = ParsedRequest(dict(body), bool(body.get("stream")), None)
    return ProxyRequest("r1", routed, "plain", received=Received(raw), prepared=Prepared(parsed))


def test_the_body_sent_is_a_value_and_the_request_is_left_as_it_was() -> None:
    req = _chat({"messages": [], "stream": True})
    before = dataclasses.replace(req)
    drafting = Upstream("plain", "http://127.0.0.1:9", speculation=Speculation(types=("ngram-mod",)))
    sent = upstream_body(req, drafting, watched=True)
    assert sent.strip  # asked for the per-token timings the client did not
    assert sent.speculation is not None and sent.speculation["set_by"] == "profile"
    assert orjson.loads(sent.body)["timings_per_token"] is True
    assert req == before and req.sent is None  # the sending stage begins its forward with it, once


def test_a_body_with_nothing_to_add_is_the_clients_bytes() -> None:
    req = _chat({"messages": []})
    assert upstream_body(req, PLAIN, watched=False) == Sent(req.body)
