"""The gate's decisions on mocked requests: the client's key is kept from llama-server unless asked otherwise."""

from __future__ import annotations

from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from multidict import CIMultiDict, CIMultiDictProxy

from adaptive_spec.access.rules import KEY_HEADERS, AccessPolicy
from adaptive_spec.requests.apis import Api
from adaptive_spec.requests.body.parse import RoutedPath
from adaptive_spec.requests.forwarding.forward import upstream_headers
from adaptive_spec.requests.gate import ACCESS, _refusal, hidden_headers, request_keys, routed_path
from adaptive_spec.requests.paths import decide_path


def _request(policy: AccessPolicy, headers: dict[str, str]) -> web.Request:
    app = web.Application()
    app[ACCESS] = policy
    return make_mocked_request("POST", "/p/x/v1/chat/completion%73", headers=headers, app=app)


def test_the_clients_key_is_not_sent_on_when_the_proxy_checks_keys() -> None:
    headers = {"Authorization": "Bearer k", "x-api-key": "k", "Host": "127.0.0.1", "Content-Type": "application/json"}
    request = _request(AccessPolicy(api_keys=("k",)), headers)
    decided = decide_path(request.raw_path)
    assert isinstance(decided, RoutedPath)
    assert _refusal(request, decided) is None
    assert hidden_headers(request) == KEY_HEADERS
    assert routed_path(request) == RoutedPath("x", "/v1/chat/completions", Api.CHAT)
    sent = upstream_headers(CIMultiDictProxy(CIMultiDict(headers)), hidden_headers(request))
    assert dict(sent) == {"Content-Type": "application/json"}


def test_the_key_goes_on_when_configured_or_when_no_key_is_checked() -> None:
    headers = {"Authorization": "Bearer k", "Host": "127.0.0.1"}
    for policy in (AccessPolicy(api_keys=("k",), forward_api_key=True), AccessPolicy()):
        request = _request(policy, headers)
        decided = decide_path(request.raw_path)
        assert isinstance(decided, RoutedPath)
        assert _refusal(request, decided) is None
        assert "Authorization" in upstream_headers(CIMultiDictProxy(CIMultiDict(headers)), hidden_headers(request))


def test_a_gemini_client_may_send_its_key_as_its_own_header_or_in_the_query() -> None:
    policy = AccessPolicy(api_keys=("k",))
    app = web.Application()
    app[ACCESS] = policy
    for target, headers in (
        ("/v1beta/models/gemini-3.1-pro-preview:generateContent", {"x-goog-api-key": "k"}),
        ("/p/gem/v1beta/models/gemini-3.1-pro-preview:generateContent?alt=sse&key=k", {}),
        ("/adaptive/requests?key=k", {}),
    ):
        request = make_mocked_request("POST", target, headers={"Host": "127.0.0.1", **headers}, app=app)
        assert request_keys(request) == ["k"]
        decided = decide_path(request.raw_path)
        assert isinstance(decided, RoutedPath)
        assert _refusal(request, decided) is None
        assert "x-goog-api-key" in hidden_headers(request)
    wrong = make_mocked_request("GET", "/v1beta/models?key=nope", headers={"Host": "127.0.0.1"}, app=app)
    decided = decide_path(wrong.raw_path)
    assert isinstance(decided, RoutedPath) and decided.api is Api.GEMINI_MODELS
    refused = _refusal(wrong, decided)
    assert refused is not None and refused.status == 401
