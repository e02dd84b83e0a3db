"""Claude Code through the proxy, on bodies of its structure (tests/data/agent-shapes/claude-code-*.json) sent to a
real llama-server: its token count, a context overflow worded so that it compacts, its session from the header or
from `metadata.user_id`, and its billing line's per-request value neither a new prompt nor a side request. A
streamed `thinking` block (the embedded models write none) and an overflow answered after the keep-alives come from
the fake upstream."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from adaptive_spec.llama.upstreams import Upstream, UpstreamTable
from adaptive_spec.proxy.app import ProxySettings, build_app
from adaptive_spec.requests.app_keys import HISTORY, LIFECYCLE
from adaptive_spec.requests.forwarding.outcome import Outcome
from adaptive_spec.requests.lifecycle import ProxyRequest
from tests.support.fakes.fake_upstream import FakeUpstream
from tests.support.processes.servers import LlamaServer, ProxyProcess, free_port
from tests.support.sse import events

SHAPES = Path(__file__).resolve().parents[2] / "data" / "agent-shapes"
BODY: dict[str, Any] = json.loads((SHAPES / "claude-code-messages.json").read_text())
MESSAGES = "/v1/messages?beta=true"
BILLING = "x-anthropic-billing-header: cc_version=2.1.328.abc; cc_entrypoint=cli; cch={};"


def _post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[int, bytes, str | None]:
    """Status, body, and the proxy's request id (None from llama-server)."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, resp.read(), resp.headers.get("x-adaptive-spec-request-id")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers.get("x-adaptive-spec-request-id")


@pytest.fixture(scope="module")
def proxy(tiny_server: LlamaServer) -> Iterator[ProxyProcess]:
    proc = ProxyProcess("--profile", f"plain={tiny_server.url}")
    yield proc
    proc.stop()


def _record(proxy: ProxyProcess, request_id: str | None) -> dict[str, Any]:
    return next(r for r in proxy.requests() if r["request_id"] == request_id)


def test_count_tokens_is_answered_as_llama_server_answers_it(tiny_server: LlamaServer, proxy: ProxyProcess) -> None:
    body = {key: BODY[key] for key in ("model", "system", "messages", "tools")}
    path = "/v1/messages/count_tokens?beta=true"
    status, direct, _ = _post(tiny_server.url + path, body)
    assert status == 200 and json.loads(direct)["input_tokens"] > 100, direct[:300]
    status, through, _ = _post(proxy.base + path, body, {"X-Claude-Code-Session-Id": "count"})
    assert (status, json.loads(through)) == (200, json.loads(direct)), through[:600]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_context_overflow_is_worded_as_anthropic_words_it(
    tiny_server: LlamaServer, proxy: ProxyProcess, stream: bool
) -> None:
    """llama-server answers an overflow in its own words; Claude Code compacts its conversation on Anthropic's."""
    body = {**BODY, "stream": stream, "messages": [{"role": "user", "content": "x " * 40_000}]}
    status, direct, _ = _post(tiny_server.url + MESSAGES, body)
    error = json.loads(direct)["error"]
    assert status == 400 and error["type"] == "exceed_context_size_error", direct[:300]
    status, through, _ = _post(proxy.base + MESSAGES, body, {"X-Claude-Code-Session-Id": "overflow"})
    expected = f"prompt is too long: {error['n_prompt_tokens']} tokens > {error['n_ctx']} maximum"
    assert status == 400
    assert json.loads(through) == {"type": "error", "error": {"type": "invalid_request_error", "message": expected}}


@pytest.mark.asyncio(loop_scope="function")
async def test_an_overflow_answered_after_the_keep_alives_is_anthropics_error_event(
    tiny_server: LlamaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama-server answers an overflow before any keep-alive goes out (the case above); one that comes after them (a
    server busy with another request first) ends the stream with Anthropic's error event in the same words, and the
    request's outcome has the code the client got. The overflow is llama-server's own answer, sent late by the fake
    upstream."""
    body = {**BODY, "stream": True, "messages": [{"role": "user", "content": "x " * 40_000}]}
    status, overflow, _ = await asyncio.to_thread(_post, tiny_server.url + MESSAGES, body)
    error = json.loads(overflow)["error"]
    assert status == 400 and error["type"] == "exceed_context_size_error", overflow[:300]

    async def late_overflow(_: web.Request) -> web.Response:
        await asyncio.sleep(1.0)  # five keep-alive intervals
        return web.Response(status=400, body=overflow, content_type="application/json")

    async with FakeUpstream(routes={("POST", "/v1/messages"): late_overflow}) as fake:
        settings = ProxySettings(prefill_keepalive_s=0.2)
        proxy = TestServer(build_app(UpstreamTable([Upstream("fake", fake.url)]), settings), port=free_port())
        await proxy.start_server()
        outcomes: list[Outcome] = []
        lifecycle = proxy.app[LIFECYCLE]
        finish = lifecycle.finish

        def finished(method: str, path: str, req: ProxyRequest, outcome: Outcome) -> None:
            outcomes.append(outcome)
            finish(method, path, req, outcome)

        monkeypatch.setattr(lifecycle, "finish", finished)
        try:
            headers = {"X-Claude-Code-Session-Id": "cc-late-overflow"}
            async with (
                aiohttp.ClientSession() as client,
                client.post(proxy.make_url(MESSAGES), json=body, headers=headers) as resp,
            ):
                got, status = await resp.read(), resp.status
        finally:
            await proxy.close()
    expected = f"prompt is too long: {error['n_prompt_tokens']} tokens > {error['n_ctx']} maximum"
    found = events(got)
    assert status == 200 and found[0].event == "ping", got[:300]
    assert found[-1].event == "error", got[-600:]
    assert json.loads(found[-1].data) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": expected},
    }
    assert [(o.status, o.code) for o in outcomes] == [(400, "invalid_request_error")], outcomes


def test_metadata_user_id_names_the_session_without_a_header(proxy: ProxyProcess) -> None:
    user_id = json.dumps({"device_id": "synthetic", "account_uuid": "", "session_id": "cc-body-session"})
    sessions = set()
    for turn in range(2):
        turn_messages = [*BODY["messages"], {"role": "user", "content": f"turn {turn}"}]
        body = {**BODY, "metadata": {"user_id": user_id}, "messages": turn_messages}
        status, raw, request_id = _post(proxy.base + MESSAGES, body)
        assert status == 200, raw[:300]
        record = _record(proxy, request_id)
        sessions.add((record["session_id"], record["session_source"]))
    assert sessions == {("cc-body-session", "body:metadata.user_id")}


def _turn(cch: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    system = [{"type": "text", "text": BILLING.format(cch)}, *BODY["system"][1:]]
    system[1] = {**system[1], "text": "You are a synthetic coding agent. Keep answers short and exact. " * 30}
    return {**BODY, "system": system, "messages": messages}


def test_a_new_billing_value_each_turn_is_neither_a_new_prompt_nor_a_side_request(proxy: ProxyProcess) -> None:
    """Claude Code's `cch=` value changes with every request; llama-server normalises it, so the turn reuses the
    cached prefix, and the proxy's digests see the same prompt head: one session, no side request, an estimate of
    the new part only (how close, on a real model: test_agent_estimates.py)."""
    headers = {"X-Claude-Code-Session-Id": "cc-billing"}
    messages: list[dict[str, Any]] = [dict(m) for m in BODY["messages"]]
    records = []
    for turn, cch in enumerate(("a1b2c", "d3e4f", "0a9b8")):
        status, raw, request_id = _post(proxy.base + MESSAGES, _turn(cch, messages), headers)
        assert status == 200, raw[:300]
        records.append(_record(proxy, request_id))
        reply = json.loads(raw)["content"]
        result = f"Output of step {turn}: " + "".join(f"line {i}: value {i * turn}\n" for i in range(60))
        messages += [
            {"role": "assistant", "content": reply or [{"type": "text", "text": "ok"}]},
            {"role": "user", "content": [{"type": "text", "text": result}]},
        ]
    assert {r["session_id"] for r in records} == {"cc-billing"}
    assert not any(r["side"] for r in records), records
    first = records[0]["timings"]["prompt_n"]
    for record in records[1:]:
        # llama-server reused the head (system prompt and tools): the new value did not break its cache ...
        assert record["timings"]["cache_n"] >= first - 8, (record["timings"], first)
        # ... and the proxy estimated the new part, not the whole prompt again (the tiny model's template renders
        # no tools, so its rate is off: well under the whole prompt is what it can say).
        assert record["new_tokens_est"] < 0.7 * (first + record["timings"]["prompt_n"]), record


THINKING_STREAM = b"".join(
    b"event: " + name + b"\ndata: " + json.dumps(data).encode() + b"\n\n"
    for name, data in [
        (
            b"message_start",
            {
                "type": "message_start",
                "message": {
                    "id": "msg_1",
                    "type": "message",
                    "role": "assistant",
                    "content": [],
                    "model": "m",
                    "stop_reason": None,
                    "usage": {"input_tokens": 40, "output_tokens": 0, "cache_read_input_tokens": 0},
                },
            },
        ),
        (b"content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking"}}),
        (
            b"content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Plan: "}},
        ),
        (
            b"content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "write it."}},
        ),
        (
            b"content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": ""}},
        ),
        (b"content_block_stop", {"type": "content_block_stop", "index": 0}),
        (
            b"content_block_start",
            {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
        ),
        (
            b"content_block_delta",
            {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Done."}},
        ),
        (b"content_block_stop", {"type": "content_block_stop", "index": 1}),
        (
            b"message_delta",
            {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 7}},
        ),
        (b"message_stop", {"type": "message_stop"}),
    ]
)


@pytest.mark.asyncio(loop_scope="function")
async def test_a_streamed_thinking_block_passes_as_it_is() -> None:
    async with FakeUpstream(answer=THINKING_STREAM, piece_bytes=7) as fake:
        proxy = TestServer(build_app(UpstreamTable([Upstream("fake", fake.url)]), ProxySettings()), port=free_port())
        await proxy.start_server()
        try:
            body = {**BODY, "stream": True}
            headers = {"X-Claude-Code-Session-Id": "cc-thinking"}
            async with (
                aiohttp.ClientSession() as client,
                client.post(proxy.make_url(MESSAGES), json=body, headers=headers) as resp,
            ):
                got = await resp.read()
                status = resp.status
            record = proxy.app[HISTORY].latest(1)[0]
        finally:
            await proxy.close()
    assert status == 200 and got == THINKING_STREAM
    assert record.outcome == "finished" and record.status == 200
    assert record.timings is not None and record.timings.predicted_n == 7 and record.ttft_ms is not None


def test_its_small_model_requests_are_side_requests_of_the_session(proxy: ProxyProcess) -> None:
    """Claude Code's title, topic and other small-model requests carry the session's header but another system
    prompt and no tools: recorded as side requests, not turns; the turn after them continues the main line."""
    headers = {"X-Claude-Code-Session-Id": "cc-side"}
    status, raw, main_id = _post(proxy.base + MESSAGES, BODY, headers)
    assert status == 200, raw[:300]
    title = {
        "model": "local",
        "max_tokens": 8,
        "system": [
            {"type": "text", "text": BILLING.format("9e8d7")},
            {"type": "text", "text": "Write a five-word title for the conversation. Reply with the title only."},
        ],
        "messages": [{"role": "user", "content": "Create hello.py that prints hello."}],
        "metadata": BODY["metadata"],
    }
    status, raw, title_id = _post(proxy.base + MESSAGES, title, headers)
    assert status == 200, raw[:300]
    follow = {
        **BODY,
        "messages": [*BODY["messages"], {"role": "assistant", "content": "ok"}, {"role": "user", "content": "Go on."}],
    }
    status, raw, next_id = _post(proxy.base + MESSAGES, follow, headers)
    assert status == 200, raw[:300]
    records = [_record(proxy, i) for i in (main_id, title_id, next_id)]
    assert [r["session_id"] for r in records] == ["cc-side"] * 3
    assert [r["side"] for r in records] == [False, True, False], records
