"""KV handoff plumbing on REAL launched profiles (tiny model): a session pinned to another profile takes its KV cache
along, into a slot the proxy names with id_slot when a profile has several; a failed restore falls back to prefill."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.models.tiny_policy import tiny_policy
from tests.support.processes.servers import ProxyProcess, chat_record, http_json, wait_until

PASTED = "Here is a.py:\n```python\n" + "\n".join(f"value_{i} = {i} * {i}" for i in range(60)) + "\n```\nWhat is it?"


@pytest.fixture(scope="module")
def two_slots(tiny_gguf: Path, llama_server_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    home = tmp_path_factory.mktemp("handoff")
    proxy = ProxyProcess(
        "--server-per-profile",  # KV handoff between two launched servers (one server: test_one_server.py)
        "--model",
        str(tiny_gguf),
        "--threads",
        "1",
        "--ctx-size",
        "8192",
        "--parallel",
        "2",
        "--policy",
        str(tiny_policy(home)),  # its slot files' handoff costs: a move pays
        env={"ADAPTIVE_SPEC_STATE_DIR": str(home / "state"), "ADAPTIVE_SPEC_CONFIG_DIR": str(home / "config")},
    )
    yield proxy, home
    proxy.stop()


def test_a_pinned_move_hands_the_kv_cache_over_into_a_named_slot(two_slots: Any) -> None:
    proxy, home = two_slots
    # Another session uses the iterative profile first: it gets slot 0 there.
    other = {"x-session-id": "other", "x-adaptive-spec-profile": "iterative"}
    chat_record(proxy, [{"role": "user", "content": "hi"}], 16, **other)
    history = [{"role": "user", "content": PASTED}]
    first = chat_record(proxy, history, 16, **{"x-session-id": "mover", "x-adaptive-spec-profile": "oneshot"})
    context = first["timings"]["prompt_n"] + first["timings"]["cache_n"]
    assert context > 300
    history += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "And now?"}]
    second = chat_record(proxy, history, 16, **{"x-session-id": "mover", "x-adaptive-spec-profile": "iterative"})
    assert (second["route"], second["moved_from"]) == ("pinned", "oneshot")
    assert second["handoff"]["ok"] and second["handoff"]["tokens"] >= context, second["handoff"]
    assert second["timings"]["cache_n"] >= context - 4, second["timings"]
    # Two slots: the proxy named the one the other session did not use last, and the session landed there.
    slots = {s["id"]: s for s in _slots(proxy, "iterative")}
    assert slots[1].get("n_prompt_tokens", 0) >= context, slots[1]
    assert list(home.glob("state/run-*/slots/as-*")) == []  # the handoff's slot file is deleted once restored
    # The head store's own file of the first turn's save (head-*.bin) is moved into the store once that save ends.
    wait_until(lambda: http_json(proxy.base + "/adaptive/heads")["pending"] == 0, 60, "the head store's saves")
    assert list(home.glob("state/run-*/slots/*")) == []


def _slots(proxy: ProxyProcess, profile: str) -> list[dict[str, Any]]:
    req = urllib.request.Request(proxy.base + "/slots", headers={"x-adaptive-spec-profile": profile})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return list(json.loads(resp.read()))


def test_a_failed_restore_falls_back_to_prefill(two_slots: Any) -> None:
    proxy, home = two_slots
    history = [{"role": "user", "content": PASTED + " (second session)"}]
    chat_record(proxy, history, 16, **{"x-session-id": "unlucky", "x-adaptive-spec-profile": "oneshot"})
    # Take the slot directory away: the save on the old profile fails, the request is served all the same.
    slot_dirs = list(home.glob("state/run-*/slots"))
    assert len(slot_dirs) == 1
    slot_dirs[0].rename(slot_dirs[0].with_name("slots-gone"))
    try:
        history += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "More?"}]
        moved = chat_record(proxy, history, 16, **{"x-session-id": "unlucky", "x-adaptive-spec-profile": "iterative"})
    finally:
        slot_dirs[0].with_name("slots-gone").rename(slot_dirs[0])
    assert moved["status"] == 200 and moved["moved_from"] == "oneshot"
    assert moved["handoff"]["ok"] is False and moved["handoff"]["error"], moved["handoff"]
    assert moved["timings"]["cache_n"] < 50  # re-prefilled
    assert http_json(proxy.base + "/adaptive/route")["handoffs"]["failed"] >= 1
