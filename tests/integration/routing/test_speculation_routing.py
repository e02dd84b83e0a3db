"""The router sets speculation per request, on the REAL patched llama-server with the real model-drafter pair:
Qwen2.5-Coder-1.5B, the 0.5B drafting for it (`serve --draft-type simple`), four settings of one server (plain,
oneshot = the drafter, iterative = drafter + ngram-mod, ngram). A first turn of prose goes to no speculation by the
prior; a prose session on the drafter leaves it within the dwell, and the reason gives the measured acceptance; a
request beside one without speculation gets the load rule's setting; a pinned drafter session gets a draft length
chosen from its acceptance; the records' draft counts equal llama-server's own.
"""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes.servers import ProxyProcess, chat_record, http_json, wait_until

ONE_SERVER = "profiles: one llama-server, speculation per request"
PASTED = "Here is a.py:\n```python\n" + "\n".join(f"value_{i} = {i} * {i}" for i in range(30)) + "\n```\n"
EDIT = PASTED + "Rename value_0 to zero. Return the complete updated file."


@pytest.fixture(scope="module")
def pair(
    llama_server_binary: str, qwen15_gguf: Path, qwen_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProxyProcess]:
    home = tmp_path_factory.mktemp("pair")
    env = {
        "ADAPTIVE_SPEC_STATE_DIR": str(home / "state"),
        "ADAPTIVE_SPEC_CONFIG_DIR": str(home / "config"),
        "ADAPTIVE_SPEC_LLAMA_SERVER": llama_server_binary,
    }
    # The load rule at one request without speculation beside (the default waits for 3: two slots here).
    policy = home / "policy.toml"
    # A move at 5% rather than the default 15%: the drafter's acceptance on prose differs by CPU (22% on one without
    # AMX repacking, where plain was estimated 11% faster and the default held the session on the drafter).
    policy.write_text("[route]\nhold_beside_plain = 1\nhysteresis = 0.05\n")
    args = ("--model", str(qwen15_gguf), "--draft", str(qwen_gguf), "--draft-type", "simple", "--policy", str(policy))
    proxy = ProxyProcess(*args, "--threads", "1", "--ctx-size", "4096", "--parallel", "2", env=env)
    try:
        if ONE_SERVER not in proxy.log():
            pytest.fail("serve did not run the settings on one patched llama-server:\n" + proxy.log())
        yield proxy
    finally:
        proxy.stop()


def _in_flight(proxy: ProxyProcess, profile: str) -> int:
    return int(http_json(proxy.base + "/adaptive/route")["in_flight"].get(profile, 0))


def test_serve_offers_four_settings_of_one_server(pair: ProxyProcess) -> None:
    profiles = {p["name"]: p for p in http_json(pair.base + "/adaptive/profiles")["profiles"]}
    assert set(profiles) == {"oneshot", "iterative", "plain", "ngram"}
    assert len({p["base_url"] for p in profiles.values()}) == 1
    log = pair.log()
    assert "per-request: types=none" in log and "per-request: types=draft-simple" in log, log


def test_a_prose_session_leaves_the_drafter_for_no_speculation(pair: ProxyProcess) -> None:
    # Before anything was measured, a first turn of prose goes by the prior: a drafter is no faster on prose.
    new = [{"role": "user", "content": "Describe a quiet morning by the sea, in three sentences."}]
    fresh = chat_record(pair, new, 16, **{"x-session-id": "prose-new"})
    assert fresh["profile"] == "plain" and "drafter accepts 15% (prior for prose)" in fresh["reason"], fresh["reason"]
    history = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write a short, friendly note inviting my neighbours to a garden party."},
    ]
    records = []
    # A prose session that starts on the drafter (its first turn pinned there), then is routed.
    follow_ups = ("Make it warmer.", "Now make it shorter.", "Add that children are welcome.")
    pins: list[dict[str, str]] = [{"x-adaptive-spec-profile": "oneshot"}, {}, {}]
    for follow_up, pin in zip(follow_ups, pins, strict=True):
        record = chat_record(pair, history, 32, **{"x-session-id": "prose", **pin})
        records.append(record)
        history += [{"role": "assistant", "content": record["text"]}, {"role": "user", "content": follow_up}]
    first, second, third = records
    assert first["profile"] == "oneshot", first["reason"]
    assert first["speculation"]["types"] == ["draft-simple"] and first["timings"]["draft_n"] > 0
    # Measured once, the drafter is slower here than no speculation: the session moves at once (one server: no
    # dwell), and the reason gives the acceptance it measured.
    accepted = first["timings"]["draft_n_accepted"] / first["timings"]["draft_n"]
    assert second["profile"] == "plain", second["reason"]
    assert f"drafter accepts {accepted:.0%} (last turn)" in second["reason"], (accepted, second["reason"])
    assert "same server as oneshot" in second["reason"] and second["handoff"] is None
    assert second["speculation"]["types"] == [] and second["timings"].get("draft_n", 0) == 0
    assert third["profile"] == "plain", third["reason"]


def test_a_request_beside_one_without_speculation_gets_the_load_rules_setting(pair: ProxyProcess) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "Count from 1 to 60."}], "max_tokens": 96}
    body |= {"temperature": 0}
    done: list[dict[str, Any]] = []

    def plain() -> None:
        req = urllib.request.Request(
            pair.base + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "x-adaptive-spec-profile": "plain"},
        )
        with urllib.request.urlopen(req, timeout=600) as resp:
            done.append(json.loads(resp.read()))

    worker = threading.Thread(target=plain)
    worker.start()
    try:
        wait_until(lambda: _in_flight(pair, "plain") >= 1, 60, "the plain request in flight")
        beside = chat_record(pair, [{"role": "user", "content": EDIT}], 8, **{"x-session-id": "edit-beside"})
    finally:
        worker.join(600)
    assert done, "the plain request finished"
    assert (beside["profile"], beside["route"]) == ("plain", "load"), beside["reason"]
    assert "held back: load: 1 request(s) without speculation decode on its server" in beside["reason"]
    assert "(route.hold_beside_plain = 1)" in beside["reason"]
    # Alone on the server, the same kind of request speculates: it copies a pasted file.
    alone = chat_record(pair, [{"role": "user", "content": "Again. " + EDIT}], 8, **{"x-session-id": "edit-alone"})
    assert alone["route"] != "load" and alone["profile"] in ("ngram", "iterative"), alone["reason"]


def test_a_drafter_sessions_draft_length_follows_its_acceptance(pair: ProxyProcess) -> None:
    history = [{"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."}]
    pin = {"x-session-id": "capped", "x-adaptive-spec-profile": "oneshot"}
    first = chat_record(pair, history, 32, **pin)
    assert first["speculation"] == {"types": ["draft-simple"], "n_max": None, "set_by": "profile"}
    history += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "Add a docstring."}]
    second = chat_record(pair, history, 32, **pin)
    cap = second["speculation"]["n_max"]
    assert second["speculation"]["set_by"] == "router" and 1 <= cap <= 16, second["speculation"]
    assert f"draft length {cap} (drafter accepted" in second["reason"], second["reason"]
    # A cap is a cap: no step drafted more than it allowed.
    timings = second["timings"]
    assert timings["draft_n"] <= cap * timings["predicted_n"], timings


def test_records_count_what_llama_server_counted(pair: ProxyProcess) -> None:
    records = [r for r in pair.requests() if r.get("timings")]
    assert records
    metrics = {}
    req = urllib.request.Request(pair.base + "/metrics", headers={"x-adaptive-spec-profile": "plain"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        if line.startswith("llamacpp:spec_decode_num_"):
            name, value = line.split()
            metrics[name] = int(float(value))
    drafted = sum(r["timings"]["draft_n"] for r in records)
    accepted = sum(r["timings"]["draft_n_accepted"] for r in records)
    assert drafted == metrics["llamacpp:spec_decode_num_draft_tokens_total"], (drafted, metrics)
    assert accepted == metrics["llamacpp:spec_decode_num_accepted_tokens_total"], (accepted, metrics)
    # Only the model drafter drafted for the drafter's turns, and its counts are its own (draft_by_type).
    for r in records:
        if r["profile"] == "oneshot":
            assert r["timings"]["drafter_n"] == r["timings"]["draft_n"], r["timings"]
