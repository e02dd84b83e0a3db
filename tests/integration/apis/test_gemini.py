"""Gemini's API through the proxy, in front of a REAL llama-server (tiny model): generateContent's text is
llama-server's own chat text at temperature 0, streamGenerateContent streams it (SSE with alt=sse, a JSON array without)
and ends with the finish reason and the usage, countTokens counts what a generation prefills, the model list names the
served model, errors take Google's shape, a history with tool calls reuses its cached prefix turn after turn, and the
key works as `x-goog-api-key` or `?key=` behind `serve --api-key` without ever showing in the records, the trace or the
logs. Synthetic bodies only (no client's own prompts)."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.gemini import sse_chunks, text_of
from tests.support.processes.servers import LlamaServer, ProxyProcess, http_json, wait_until
from tests.support.sse import stream_events

KEY = "sk-gemini-test-5f1c2e"
PROJECT_KEY = "sk-gemini-project-9a7b"
FLASH = "gemini-3.5-flash-lite"
PRO = "gemini-3.1-pro-preview"
CONFIG = {"temperature": 0, "seed": 1, "maxOutputTokens": 12}
BODY: dict[str, Any] = {
    "systemInstruction": {"parts": [{"text": "You are a terse assistant."}]},
    "contents": [{"role": "user", "parts": [{"text": "Name three colours."}]}],
    "generationConfig": CONFIG,
}


@pytest.fixture(scope="module")
def proxy(tiny_server: LlamaServer) -> Iterator[ProxyProcess]:
    proc = ProxyProcess("--profile", f"plain={tiny_server.url}")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def keyed(tiny_server: LlamaServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ProxyProcess, Path]]:
    home = tmp_path_factory.mktemp("keyed")
    (home / "key").write_text(KEY + "\n")
    trace = home / "trace.jsonl"
    proc = ProxyProcess(
        "--profile",
        f"plain={tiny_server.url}",
        "--api-key-file",
        str(home / "key"),
        "--project-key",
        f"{PROJECT_KEY}=gemproj",
        "--trace",
        str(trace),
        "--trace-content",
    )
    yield proc, trace
    proc.stop()


def _post(url: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _record(proxy: ProxyProcess, request_id: str, key: str | None = None) -> dict[str, Any]:
    """The request's record (written as its handler ends, which may be a moment after its answer went out); `key`: the
    proxy's, sent as `?key=` (which every route takes)."""

    def found() -> list[dict[str, Any]]:
        listed = json.loads(_get(f"{proxy.base}/adaptive/requests" + (f"?key={key}" if key else ""))[1])["requests"]
        return [r for r in listed if r["request_id"] == request_id]

    wait_until(lambda: bool(found()), 10, "the record")
    return found()[0]


def _direct_text(server: LlamaServer) -> str:
    """The same request as a chat completion, straight to llama-server."""
    body = {
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Name three colours."},
        ],
        "temperature": 0,
        "seed": 1,
        "max_tokens": 12,
    }
    return str(http_json(server.url + "/v1/chat/completions", body)["choices"][0]["message"]["content"])


def test_generate_content_answers_llama_servers_own_text_in_geminis_shape(
    proxy: ProxyProcess, tiny_server: LlamaServer
) -> None:
    status, headers, data = _post(f"{proxy.base}/p/gem/v1beta/models/{FLASH}:generateContent", BODY)
    assert status == 200, data
    out = json.loads(data)
    candidate = out["candidates"][0]
    assert text_of([out]) == _direct_text(tiny_server)
    assert candidate["finishReason"] in ("MAX_TOKENS", "STOP") and candidate["content"]["role"] == "model"
    assert out["modelVersion"] == FLASH
    record = _record(proxy, headers["x-adaptive-spec-request-id"])
    assert (record["api"], record["model"], record["project"], record["status"]) == ("gemini", FLASH, "gem", 200)
    assert record["session_id"] is not None and record["not_honoured"] is None
    timings = record["timings"]
    usage = out["usageMetadata"]
    assert usage["promptTokenCount"] == timings["prompt_n"] + timings["cache_n"]
    assert usage["candidatesTokenCount"] == timings["predicted_n"]
    assert usage["totalTokenCount"] == usage["promptTokenCount"] + usage["candidatesTokenCount"]
    assert usage.get("cachedContentTokenCount", 0) == timings["cache_n"]


def test_stream_generate_content_streams_sse_and_ends_with_the_finish_reason_and_usage(
    proxy: ProxyProcess, tiny_server: LlamaServer
) -> None:
    url = f"{proxy.base}/v1beta/models/{PRO}:streamGenerateContent?alt=sse"
    status, headers, data = _post(url, BODY)
    assert status == 200, data
    assert headers["content-type"].startswith("text/event-stream")
    chunks = sse_chunks(data)
    assert text_of(chunks) == _direct_text(tiny_server)
    assert [c["candidates"][0].get("finishReason") is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    for chunk in chunks:  # no empty text part (Gemini CLI skips a chunk that has one)
        assert all(p.get("text") != "" for p in chunk["candidates"][0]["content"].get("parts", []))
    record = _record(proxy, headers["x-adaptive-spec-request-id"])
    assert (record["api"], record["model"], record["stream"]) == ("gemini", PRO, True)
    timings = record["timings"]
    assert chunks[-1]["usageMetadata"]["promptTokenCount"] == timings["prompt_n"] + timings["cache_n"]
    assert chunks[-1]["usageMetadata"]["candidatesTokenCount"] == timings["predicted_n"]


def test_without_alt_sse_the_stream_is_one_json_array(proxy: ProxyProcess, tiny_server: LlamaServer) -> None:
    status, headers, data = _post(f"{proxy.base}/v1beta/models/{PRO}:streamGenerateContent", BODY)
    assert status == 200, data
    assert headers["content-type"].startswith("application/json")
    chunks = json.loads(data)
    assert isinstance(chunks, list) and chunks
    assert text_of(chunks) == _direct_text(tiny_server)
    assert chunks[-1]["candidates"][0]["finishReason"] in ("MAX_TOKENS", "STOP")
    assert "usageMetadata" in chunks[-1]


def test_count_tokens_counts_what_a_generation_prefills(proxy: ProxyProcess) -> None:
    status, _, data = _post(
        f"{proxy.base}/p/gem/v1beta/models/{FLASH}:countTokens",
        {"contents": BODY["contents"], "systemInstruction": BODY["systemInstruction"]},
    )
    assert status == 200, data
    counted = json.loads(data)["totalTokens"]
    status, _, data = _post(f"{proxy.base}/p/gem/v1beta/models/{FLASH}:generateContent", BODY)
    assert status == 200
    assert counted == json.loads(data)["usageMetadata"]["promptTokenCount"]
    wrapped = {"generateContentRequest": {"model": f"models/{FLASH}", **BODY}}
    assert json.loads(_post(f"{proxy.base}/v1beta/models/{FLASH}:countTokens", wrapped)[2])["totalTokens"] == counted


def test_the_model_list_names_the_served_model_and_any_name_is_served(proxy: ProxyProcess) -> None:
    status, data = _get(f"{proxy.base}/p/gem/v1beta/models")
    assert status == 200
    models = json.loads(data)["models"]
    assert [m["name"] for m in models] == ["models/tiny-random-llama.gguf"]
    status, data = _get(f"{proxy.base}/v1beta/models/{PRO}")
    one = json.loads(data)
    assert status == 200 and one["name"] == f"models/{PRO}" and one["inputTokenLimit"] > 0
    assert "generateContent" in one["supportedGenerationMethods"]


@pytest.mark.parametrize(
    ("body", "status", "google_status"),
    [
        (b"{not json", 400, "INVALID_ARGUMENT"),
        ({"contents": []}, 400, "INVALID_ARGUMENT"),
        ({**BODY, "generationConfig": {"candidateCount": 2}}, 400, "INVALID_ARGUMENT"),
    ],
)
def test_errors_take_googles_shape(proxy: ProxyProcess, body: Any, status: int, google_status: str) -> None:
    got, _, data = _post(f"{proxy.base}/v1beta/models/{FLASH}:generateContent", body)
    error = json.loads(data)["error"]
    assert (got, error["code"], error["status"]) == (status, status, google_status)
    assert isinstance(error["message"], str) and error["message"]


def test_a_generation_asked_with_get_is_refused_in_googles_shape(proxy: ProxyProcess) -> None:
    status, data = _get(f"{proxy.base}/v1beta/models/{FLASH}:generateContent")
    assert (status, json.loads(data)["error"]["status"]) == (405, "INVALID_ARGUMENT")


def test_hosted_only_fields_are_taken_and_named_in_the_record(proxy: ProxyProcess) -> None:
    body = {
        **BODY,
        "generationConfig": {**CONFIG, "thinkingConfig": {"thinkingBudget": 0}},
        "safetySettings": [{"category": "HARM_CATEGORY_HARASSMENT", "threshold": "BLOCK_NONE"}],
        "tools": [{"googleSearch": {}}],
    }
    status, headers, data = _post(f"{proxy.base}/v1beta/models/{FLASH}:generateContent", body)
    assert status == 200, data
    record = _record(proxy, headers["x-adaptive-spec-request-id"])
    assert record["not_honoured"] == "safetySettings, tools[0].googleSearch, generationConfig.thinkingConfig"


def _tool_turns() -> tuple[dict[str, Any], dict[str, Any]]:
    """Two turns of one conversation with tool calls that carry no ids (the proxy derives them)."""
    tools = [
        {
            "functionDeclarations": [
                {
                    "name": "read_file",
                    "description": "Read a file.",
                    "parametersJsonSchema": {
                        "type": "object",
                        "properties": {"path": {"type": "string"}},
                        "required": ["path"],
                    },
                },
                {
                    "name": "list_dir",
                    "description": "List a folder.",
                    "parameters": {"type": "OBJECT", "properties": {"dir": {"type": "STRING", "nullable": True}}},
                },
            ]
        }
    ]
    history = [
        {"role": "user", "parts": [{"text": "What is in notes.txt?"}]},
        {
            "role": "model",
            "parts": [
                {
                    "functionCall": {"name": "read_file", "args": {"path": "notes.txt"}},
                    "thoughtSignature": "c2lnbmF0dXJl",
                }
            ],
        },
        {"role": "user", "parts": [{"functionResponse": {"name": "read_file", "response": {"output": "buy milk"}}}]},
    ]
    first = {"contents": history, "tools": tools, "generationConfig": {**CONFIG, "maxOutputTokens": 4}}
    later = [
        *history,
        {"role": "model", "parts": [{"text": "It says to buy milk."}]},
        {"role": "user", "parts": [{"text": "Thanks."}]},
    ]
    return first, {**first, "contents": later}


def test_a_history_with_tool_calls_keeps_its_cached_prefix_turn_after_turn(proxy: ProxyProcess) -> None:
    first, second = _tool_turns()
    url = f"{proxy.base}/p/tools/v1beta/models/{PRO}:generateContent"
    status, headers, data = _post(url, first)
    assert status == 200, data
    one = _record(proxy, headers["x-adaptive-spec-request-id"])
    status, headers, data = _post(url, second)
    assert status == 200, data
    two = _record(proxy, headers["x-adaptive-spec-request-id"])
    # The second turn's prompt starts with the whole first one: its ids rendered alike, llama-server reuses it.
    assert two["timings"]["cache_n"] >= one["timings"]["prompt_n"] + one["timings"]["cache_n"] - 1
    assert json.loads(data)["usageMetadata"]["cachedContentTokenCount"] == two["timings"]["cache_n"]


def test_the_key_goes_as_header_or_query_and_never_shows(keyed: tuple[ProxyProcess, Path]) -> None:
    proxy, trace = keyed
    url = f"{proxy.base}/p/kp/v1beta/models/{FLASH}:generateContent"
    status, _, data = _post(url, BODY)
    error = json.loads(data)["error"]
    assert (status, error["status"]) == (401, "UNAUTHENTICATED") and "x-goog-api-key" in error["message"]
    status, headers, _ = _post(url, BODY, {"x-goog-api-key": KEY})
    assert status == 200
    header_id = headers["x-adaptive-spec-request-id"]
    status, headers, _ = _post(f"{url}?key={KEY}", BODY)
    assert status == 200
    query_id = headers["x-adaptive-spec-request-id"]
    status, _, data = _post(f"{proxy.base}/v1beta/models/{PRO}:streamGenerateContent?alt=sse&key={KEY}", BODY)
    assert status == 200 and sse_chunks(data)[-1]["candidates"][0]["finishReason"]
    assert _get(f"{proxy.base}/v1beta/models?key={KEY}")[0] == 200
    assert _get(f"{proxy.base}/v1beta/models?key=wrong")[0] == 401
    assert _post(f"{proxy.base}/v1beta/models/{FLASH}:countTokens?key={KEY}", BODY)[0] == 200
    # The records (and the feed's), the trace with its content and the proxy's own output never hold the key.
    records = _get(f"{proxy.base}/adaptive/requests?key={KEY}")[1].decode()
    assert header_id in records and query_id in records
    assert all(
        r["path"] == "/p/kp/v1beta/models/gemini-3.5-flash-lite:generateContent"
        for r in json.loads(records)["requests"]
        if r["request_id"] in (header_id, query_id)
    )
    assert KEY not in records
    assert trace.read_text().count('"request_id"') >= 3
    assert KEY not in trace.read_text()
    assert KEY not in proxy.log()


def test_keepalives_before_the_first_chunk_leave_the_stream_as_it_was(tiny_server: LlamaServer) -> None:
    """Keep-alives every millisecond, so some may go out before the server's first chunk: the text is unchanged."""
    proxy = ProxyProcess("--profile", f"plain={tiny_server.url}", "--prefill-keepalive", "0.001")
    try:
        url = f"{proxy.base}/v1beta/models/{PRO}:streamGenerateContent"
        status, _, data = _post(url + "?alt=sse", BODY)
        assert status == 200 and text_of(sse_chunks(data, keepalives=True)) == _direct_text(tiny_server)
        status, _, data = _post(url, BODY)
        assert status == 200 and text_of(json.loads(data)) == _direct_text(tiny_server)
    finally:
        proxy.stop()


def test_a_watched_stream_carries_the_live_text_and_answers_the_same(tiny_server: LlamaServer) -> None:
    """With the live feed subscribed (and its text on), the proxy asks llama-server for per-token timings and cuts them
    out again before the translation: the Gemini stream is the same, and the feed shows the reply's text."""
    proxy = ProxyProcess("--profile", f"plain={tiny_server.url}", "--feed-content")
    seen: list[tuple[str, dict[str, Any]]] = []
    feed = urllib.request.urlopen(proxy.base + "/adaptive/events", timeout=60)

    def read() -> None:
        try:
            seen.extend((e.event, json.loads(e.data)) for e in stream_events(feed))
        except (OSError, ValueError, AttributeError):  # closed under the reader
            return

    threading.Thread(target=read, daemon=True).start()
    try:
        wait_until(lambda: bool(seen), 10, "the snapshot")
        status, headers, data = _post(f"{proxy.base}/v1beta/models/{PRO}:streamGenerateContent?alt=sse", BODY)
        assert status == 200 and text_of(sse_chunks(data)) == _direct_text(tiny_server)
        request_id = headers["x-adaptive-spec-request-id"]
        wait_until(lambda: any(k == "RequestFinished" for k, _ in seen), 10, "the finish")
        progress = [d for k, d in seen if k == "DraftProgress" and d["request_id"] == request_id]
        live = "".join(piece for d in progress for piece, _accepted in d.get("text") or [])
        assert live == _direct_text(tiny_server)
    finally:
        feed.close()
        proxy.stop()


def test_a_project_key_files_gemini_requests_under_its_project(keyed: tuple[ProxyProcess, Path]) -> None:
    proxy, _ = keyed
    url = f"{proxy.base}/v1beta/models/{FLASH}:generateContent"
    for target, headers in ((url, {"x-goog-api-key": PROJECT_KEY}), (f"{url}?key={PROJECT_KEY}", {})):
        status, answer_headers, data = _post(target, BODY, headers)
        assert status == 200, data
        assert _record(proxy, answer_headers["x-adaptive-spec-request-id"], KEY)["project"] == "gemproj"
