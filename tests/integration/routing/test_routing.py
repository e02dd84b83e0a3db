"""Routing on real launched profiles (Qwen2.5-Coder-0.5B, -t 1): one-shot prompts to the plain profile, copy-heavy
work to the n-gram one, a moving session's KV cache handed over through slot files, pins, policy reloads, and
falling back when a profile dies."""

from __future__ import annotations

import os
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.processes.servers import ProxyProcess, http_json, http_text, llama_children, wait_until
from tests.support.processes.servers import chat_record as chat
from tests.support.prompts import EDIT, SOURCE

# Turns over quickly on this CPU: hand over any context, move after one turn, small hysteresis.
POLICY = """\
[route]
min_dwell_turns = 1
hysteresis = 0.05

[handoff]
min_tokens = 0
"""
EXPLAIN = f"```python\n{SOURCE}\n```\n\nIn one sentence: what does this module do?"


@pytest.fixture(scope="module")
def routed(
    qwen_gguf: Path, llama_server_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ProxyProcess, Path, Path]]:
    home = tmp_path_factory.mktemp("routing")
    policy = home / "policy.toml"
    policy.write_text(POLICY)
    env = {"ADAPTIVE_SPEC_STATE_DIR": str(home / "state"), "ADAPTIVE_SPEC_CONFIG_DIR": str(home / "config")}
    # One process per profile: the moves below hand the KV over between two servers.
    args = ("--threads", "1", "--ctx-size", "8192", "--server-per-profile", "--policy", str(policy))
    proxy = ProxyProcess(*args, env=env)
    yield proxy, policy, home
    proxy.stop()


def test_one_shot_to_plain_copy_heavy_first_turn_to_ngram(routed: tuple[ProxyProcess, Path, Path]) -> None:
    proxy, _, _ = routed
    one = chat(proxy, [{"role": "user", "content": "What is 12 + 30? Reply with the number only."}], 8)
    assert (one["profile"], one["route"]) == ("oneshot", "estimate"), one["reason"]
    assert one["reason"].startswith("oneshot: copyable 0% (no history)")
    edit = chat(proxy, [{"role": "user", "content": EDIT}], 24)
    assert (edit["profile"], edit["route"]) == ("iterative", "estimate"), edit["reason"]
    assert "prompt asks for a pasted file back" in edit["reason"]


def test_a_pin_overrides_the_estimate(routed: tuple[ProxyProcess, Path, Path]) -> None:
    proxy, _, _ = routed
    pinned = chat(proxy, [{"role": "user", "content": EDIT}], 8, **{"x-adaptive-spec-profile": "oneshot"})
    assert (pinned["profile"], pinned["route"]) == ("oneshot", "pinned")


def test_a_session_that_turns_copy_heavy_moves_with_its_kv_cache(routed: tuple[ProxyProcess, Path, Path]) -> None:
    proxy, _, home = routed
    sid = {"x-session-id": "handoff-1"}
    history = [{"role": "user", "content": EXPLAIN}]
    first = chat(proxy, history, 32, **sid)
    assert first["profile"] == "oneshot", first["reason"]
    history += [
        {"role": "assistant", "content": first["text"]},
        {"role": "user", "content": "Rename `cheapest` to `cheapest_item`. Return the complete updated file."},
    ]
    http_json(proxy.base + "/adaptive/sessions?drain=1")
    second = chat(proxy, history, 160, **sid)
    assert second["profile"] == "iterative" and second["moved_from"] == "oneshot", second["reason"]
    assert second["handoff"]["ok"], second["handoff"]
    assert "hands its KV over from oneshot" in second["reason"]
    # The restored slot served the conversation so far: only the new turn was prefilled.
    cached = first["timings"]["prompt_n"] + first["timings"]["cache_n"]
    assert second["timings"]["cache_n"] >= cached - 4, second["timings"]
    assert second["timings"]["prompt_n"] < second["timings"]["cache_n"]
    # Greedy text after the restore equals the text after a re-prefill of the same prompt on the same profile.
    _erase(proxy, "iterative")
    again = chat(proxy, history, 160, **{"x-adaptive-spec-profile": "iterative", "x-session-id": "handoff-1-again"})
    assert again["timings"]["cache_n"] < cached // 2, again["timings"]
    assert again["text"] == second["text"], (again["text"], second["text"])
    # The slot file was cleaned up.
    assert list(home.glob("state/run-*/slots/*")) == []
    assert http_json(proxy.base + "/adaptive/route")["handoffs"]["ok"] >= 1
    metrics = http_text(proxy.base + "/metrics")
    assert 'adaptive_spec_kv_handoffs_total{outcome="ok"} 1.0' in metrics
    assert 'adaptive_spec_session_moves_total{from_profile="oneshot",to_profile="iterative"} 1.0' in metrics
    assert 'adaptive_spec_route_decisions_total{profile="iterative",route="estimate"}' in metrics


def _erase(proxy: ProxyProcess, profile: str) -> None:
    # The proxy's own erase: clients' slot actions are refused, as the proxy owns the slots.
    req = urllib.request.Request(proxy.base + f"/adaptive/profiles/{profile}/erase", method="POST")
    with urllib.request.urlopen(req, timeout=60) as resp:
        resp.read()


def test_a_changed_policy_is_reloaded_and_a_bad_one_keeps_the_last_good(
    routed: tuple[ProxyProcess, Path, Path],
) -> None:
    proxy, policy, _ = routed
    question = [{"role": "user", "content": "Name one prime number. Reply with the number only."}]
    policy.write_text(POLICY.replace("[route]\n", '[route]\nforce = "iterative"\n'))
    wait_until(lambda: "reloaded" in proxy.log(), 15, "the policy to be reloaded")
    forced = chat(proxy, question, 4)
    assert (forced["profile"], forced["route"]) == ("iterative", "forced")
    policy.write_text(POLICY.replace("[route]\n", '[route]\nforce = "iterativ"\nhysterisis = 0.2\n'))
    wait_until(lambda: "keeping the last good" in proxy.log(), 15, "the bad policy to be reported")
    assert "route.force:2" in proxy.log() and "did you mean 'iterative'" in proxy.log()
    assert "route.hysterisis:3" in proxy.log() and "did you mean 'hysteresis'" in proxy.log()
    problems = http_json(proxy.base + "/adaptive/route")["policy_problems"]
    assert any("route.force:2" in p for p in problems), problems
    still = chat(proxy, question, 4)
    assert (still["profile"], still["route"]) == ("iterative", "forced")  # the last good policy is in force
    policy.write_text(POLICY)
    wait_until(lambda: not http_json(proxy.base + "/adaptive/route")["policy_problems"], 15, "the fixed policy")
    back = chat(proxy, question, 4)
    assert (back["profile"], back["route"]) == ("oneshot", "estimate"), back["reason"]


def test_a_dead_profile_is_passed_over(routed: tuple[ProxyProcess, Path, Path]) -> None:
    proxy, _, _ = routed
    by_name = {name: pid for pid, name in llama_children(proxy).items()}
    os.kill(by_name["oneshot"], signal.SIGKILL)
    wait_until(
        lambda: not http_json(proxy.base + "/adaptive/health")["profiles"]["oneshot"]["up"],
        30,
        "the killed profile to be marked down",
    )
    answer = chat(proxy, [{"role": "user", "content": "What is 2 + 2? Reply with the number only."}], 4)
    assert (answer["profile"], answer["route"]) == ("iterative", "fallback"), answer["reason"]
    assert answer["reason"].startswith("iterative: oneshot is down")
    wait_until(
        lambda: http_json(proxy.base + "/adaptive/health")["profiles"]["oneshot"]["up"], 120, "the profile to restart"
    )
