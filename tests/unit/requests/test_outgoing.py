"""Where a request is sent: its own path and query (a Gemini client's `?key=` taken out, however it is spelled), or
the chat completions path a Gemini body was translated for, without the client's query."""

from __future__ import annotations

import pytest
from aiohttp.test_utils import make_mocked_request

from adaptive_spec.llama.upstreams import Upstream
from adaptive_spec.requests.body.parse import RoutedPath
from adaptive_spec.requests.outgoing import upstream_path, upstream_target
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
