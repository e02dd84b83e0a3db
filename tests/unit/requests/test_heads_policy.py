"""The head store's side of the request path reads the project's heads policy as it was resolved before routing
(`Prepared.policy`), not by a second lookup."""

from __future__ import annotations

from adaptive_spec.policy.model import HeadsPolicy, Policy
from adaptive_spec.requests.body.parse import ParsedRequest, RoutedPath
from adaptive_spec.requests.body.values import Prepared
from adaptive_spec.requests.heads import heads_policy
from adaptive_spec.requests.lifecycle import ProxyRequest
from adaptive_spec.requests.paths import decide_path


def _request(prepared: Prepared | None) -> ProxyRequest:
    routed = decide_path("/v1/chat/completions")
    assert isinstance(routed, RoutedPath)
    return ProxyRequest("r1", routed, "plain", prepared=prepared)


def test_the_heads_policy_is_the_one_resolved_before_routing() -> None:
    parsed = ParsedRequest({"messages": []}, False, None)
    off = Policy(heads=HeadsPolicy(enabled=False, min_tokens=7))
    assert heads_policy(_request(Prepared(parsed, project="p", policy=off))) == off.heads
    on = Policy(heads=HeadsPolicy(min_tokens=9))
    assert heads_policy(_request(Prepared(parsed, project="p", policy=on))) == on.heads
    assert not heads_policy(_request(None)).enabled  # not prepared: nothing to keep or restore
