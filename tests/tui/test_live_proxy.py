"""The TUI against a REAL proxy in front of REAL llama-servers: pins through the control endpoint, reconnecting to a
proxy that restarts, and figures that equal the records and llama-server's own counters."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from adaptive_spec.tui.app import make_app
from adaptive_spec.tui.feed import FeedItem
from adaptive_spec.tui.model import Dashboard
from tests.support.models.tiny_policy import tiny_policy
from tests.support.processes.servers import ProxyProcess, chat_record, free_port, http_text
from tests.support.waiting import turns, until

PASTED = "Here is a.py:\n```python\n" + "\n".join(f"value_{i} = {i} * {i}" for i in range(60)) + "\n```\nWhat is it?"


def _serve(tiny_gguf: Path, home: Path, port: int | None = None, *extra: str) -> ProxyProcess:
    env = {"ADAPTIVE_SPEC_STATE_DIR": str(home / "state"), "ADAPTIVE_SPEC_CONFIG_DIR": str(home / "config")}
    # One process per profile: the pinned move below hands the KV over between two servers.
    args = ("--model", str(tiny_gguf), "--threads", "1", "--ctx-size", "4096", "--server-per-profile", *extra)
    args += ("--policy", str(tiny_policy(home)))  # its slot files' handoff costs: the move below pays
    return ProxyProcess(*args, env=env, port=port)


@pytest.fixture(scope="module")
def tiny_proxy(tiny_gguf: Path, llama_server_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    proxy = _serve(tiny_gguf, tmp_path_factory.mktemp("tui-live"))
    yield proxy
    proxy.stop()


def _post(url: str, body: Any) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_pinned_session_goes_to_its_profile_and_its_kv_follows(tiny_proxy: ProxyProcess) -> None:
    history = [{"role": "user", "content": PASTED}]
    first = chat_record(tiny_proxy, history, 16, **{"x-session-id": "pinme", "x-adaptive-spec-profile": "oneshot"})
    assert first["profile"] == "oneshot"
    context = first["timings"]["prompt_n"] + first["timings"]["cache_n"]
    status, answer = _post(tiny_proxy.base + "/adaptive/sessions/pinme/pin", {"profile": "iterative"})
    assert (status, answer) == (200, {"session_id": "pinme", "profile": "iterative", "pinned": True})
    history += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "And now?"}]
    second = chat_record(tiny_proxy, history, 16, **{"x-session-id": "pinme"})
    assert (second["profile"], second["route"], second["moved_from"]) == ("iterative", "pinned", "oneshot")
    assert "the session's pin" in second["reason"]
    assert second["handoff"]["ok"] and second["handoff"]["tokens"] >= context, second["handoff"]
    assert second["timings"]["cache_n"] >= context - 4, second["timings"]
    history += [{"role": "assistant", "content": second["text"]}, {"role": "user", "content": "Once more."}]
    third = chat_record(tiny_proxy, history, 16, **{"x-session-id": "pinme"})
    assert (third["profile"], third["route"]) == ("iterative", "pinned")  # sticky, unlike the header
    route = json.loads(http_text(tiny_proxy.base + "/adaptive/route"))
    assert route["pins"] == {"pinme": "iterative"}
    assert _post(tiny_proxy.base + "/adaptive/sessions/pinme/pin", {"profile": None})[0] == 200
    history += [{"role": "assistant", "content": third["text"]}, {"role": "user", "content": "And last."}]
    fourth = chat_record(tiny_proxy, history, 16, **{"x-session-id": "pinme"})
    assert fourth["route"] != "pinned"


def test_pin_refuses_what_it_cannot_do(tiny_proxy: ProxyProcess) -> None:
    chat_record(tiny_proxy, [{"role": "user", "content": "hi"}], 4, **{"x-session-id": "known"})
    status, answer = _post(tiny_proxy.base + "/adaptive/sessions/known/pin", {"profile": "nope"})
    assert status == 404 and answer["error"]["code"] == "unknown_profile"
    status, answer = _post(tiny_proxy.base + "/adaptive/sessions/unheard-of/pin", {"profile": "oneshot"})
    assert status == 404 and answer["error"]["code"] == "unknown_session"
    for bad in ({"profile": 3}, ["oneshot"], {}):
        status, answer = _post(tiny_proxy.base + "/adaptive/sessions/known/pin", bad)
        assert status == 400 and answer["error"]["param"] == "profile", bad


@pytest.mark.asyncio(loop_scope="function")
async def test_the_view_follows_a_proxy_that_restarts_and_its_figures_equal_the_records(
    tiny_gguf: Path, llama_server_binary: str, tmp_path: Path
) -> None:
    port = free_port()
    proxy = await asyncio.to_thread(_serve, tiny_gguf, tmp_path, port)
    app = make_app(url=proxy.base, frame_s=0.05)
    try:
        async with app.run_test(size=(120, 36)) as pilot:
            await until(lambda: app.connected and "oneshot" in app.dashboard.profiles, "the snapshot")
            await until(lambda: app.dashboard.policy_sources is not None, "the policy from /adaptive/route")
            for i in range(3):
                body = [{"role": "user", "content": f"turn {i}"}]
                await asyncio.to_thread(chat_record, proxy, body, 8, **{"x-session-id": "watched"})
            await until(lambda: turns(app, "watched") == 3, "three turns")
            records = [r for r in proxy.requests() if r["session_id"] == "watched"]
            view = app.dashboard.sessions["watched"]
            assert view.predicted_n == sum(r["timings"]["predicted_n"] for r in records)
            assert {t.request_id for t in view.turns} == {r["request_id"] for r in records}
            # A feed that dropped events: the view says so and takes what it missed from /adaptive/requests.
            app.dashboard = Dashboard()
            app.handle(FeedItem("EventsDropped", {"count": 7}))
            await until(lambda: turns(app, "watched") == 3, "the resync from the request history")
            assert any("7 events dropped" in line.text for line in app.dashboard.log)
            await asyncio.to_thread(proxy.stop)
            await until(lambda: not app.connected, "the disconnect")
            assert any("disconnected" in line.text for line in app.dashboard.log)
            proxy = await asyncio.to_thread(_serve, tiny_gguf, tmp_path, port)
            await until(lambda: app.connected, "the reconnect")
            await until(lambda: app.dashboard.requests_total == 0, "a fresh snapshot of the new proxy")
            await asyncio.to_thread(chat_record, proxy, [{"role": "user", "content": "back"}], 4)
            await until(lambda: app.dashboard.requests_total == 1, "a request after the restart")
            await pilot.pause()
    finally:
        await asyncio.to_thread(proxy.stop)


@pytest.mark.asyncio(loop_scope="function")
async def test_a_proxy_that_wants_a_key_is_named_as_such_and_the_key_lets_the_view_in(
    tiny_gguf: Path, llama_server_binary: str, tmp_path: Path
) -> None:
    proxy = await asyncio.to_thread(_serve, tiny_gguf, tmp_path, None, "--api-key", "s3cret")
    try:
        refused = make_app(url=proxy.base, frame_s=0.05)
        async with refused.run_test(size=(100, 30)):
            await until(lambda: refused.last_error.startswith("401"), "the refusal")
            await until(lambda: "refused this view" in str(refused.query_one("#banner").render()), "the banner")
        keyed = make_app(url=proxy.base, api_key="s3cret", frame_s=0.05)
        async with keyed.run_test(size=(100, 30)):
            await until(lambda: keyed.connected and "oneshot" in keyed.dashboard.profiles, "the snapshot with the key")
    finally:
        await asyncio.to_thread(proxy.stop)
