"""Through the proxy, a real llama-server answers exactly as it does directly (openai SDK as the client)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessageParam

from tests.support.processes.servers import LlamaServer, ProxyProcess, http_json
from tests.support.sse import data_objects

CHAT: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Write a haiku about diffs."},
]
GREEDY: dict[str, Any] = {"model": "local", "temperature": 0, "max_tokens": 48}


@pytest.fixture(scope="module")
def proxy(tiny_server: LlamaServer) -> Iterator[ProxyProcess]:
    proc = ProxyProcess("--profile", f"plain={tiny_server.url}", "--max-body-mb", "1")
    yield proc
    proc.stop()


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base, api_key="sk-none", max_retries=0, timeout=60)


def _chat_text(client: openai.OpenAI, stream: bool) -> str:
    chat = client.chat.completions
    if not stream:
        return chat.create(messages=CHAT, model="m", temperature=0, max_tokens=48).choices[0].message.content or ""
    chunks: openai.Stream[ChatCompletionChunk] = chat.create(
        messages=CHAT,
        model="m",
        temperature=0,
        max_tokens=48,
        stream=True,
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _completion_text(client: openai.OpenAI, stream: bool) -> str:
    prompt = "def fibonacci(n):"
    if not stream:
        return client.completions.create(prompt=prompt, model="m", temperature=0, max_tokens=48).choices[0].text
    chunks = client.completions.create(prompt=prompt, model="m", temperature=0, max_tokens=48, stream=True)
    return "".join(c.choices[0].text for c in chunks)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_same_text_through_proxy_as_direct(
    tiny_server: LlamaServer, proxy: ProxyProcess, kind: str, stream: bool
) -> None:
    fetch = _chat_text if kind == "chat" else _completion_text
    direct = fetch(_client(tiny_server.url + "/v1"), stream)
    proxied = fetch(_client(proxy.base + "/p/projA/v1"), stream)
    assert len(direct) > 10
    assert proxied == direct


def test_record_matches_what_llama_server_reported(proxy: ProxyProcess) -> None:
    body = {"messages": CHAT, **GREEDY, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(proxy.base + "/p/recorded/v1/chat/completions", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=60) as resp:
        request_id = resp.headers["x-adaptive-spec-request-id"]
        assert resp.headers["x-adaptive-spec-profile"] == "plain"
        events = data_objects(resp.read())
    reported = events[-1]["timings"]
    record = next(r for r in proxy.requests() if r["request_id"] == request_id)
    assert (record["api"], record["project"], record["profile"], record["stream"]) == (
        "chat",
        "recorded",
        "plain",
        True,
    )
    assert (record["outcome"], record["status"], record["error"]) == ("finished", 200, None)
    for key in ("prompt_n", "cache_n", "predicted_n", "predicted_per_second"):
        assert record["timings"][key] == reported[key]
    assert (record["timings"]["draft_n"], record["timings"]["draft_n_accepted"]) == (0, 0)
    assert 0 < record["ttft_ms"] <= record["ttst_ms"] <= record["total_ms"]


def _output_tokens(raw: bytes, stream: bool) -> int:
    """The output tokens llama-server reported in its own answer (Responses or Messages, streamed or not)."""
    if not stream:
        return int(json.loads(raw)["usage"]["output_tokens"])
    counts = []
    for event in data_objects(raw):
        usage = event.get("usage") or (event.get("response") or {}).get("usage") or {}
        if "output_tokens" in usage:
            counts.append(int(usage["output_tokens"]))
    assert counts, "the stream reported no output tokens"
    return counts[-1]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/responses", {"input": "hello", "max_output_tokens": 8, "stream": True}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}),
        ("/v1/responses", {"input": "hello", "max_output_tokens": 8}),
    ],
)
def test_responses_and_anthropic_messages_are_recorded(proxy: ProxyProcess, path: str, body: dict[str, Any]) -> None:
    # Greedy, so the random-weight model's answer is the same every run; the record is compared with the count
    # llama-server put in its own answer (a sampled end-of-generation token can stop it before max_tokens).
    payload = {"model": "m", "temperature": 0, **body}
    req = urllib.request.Request(proxy.base + path, data=json.dumps(payload).encode())
    with urllib.request.urlopen(req, timeout=60) as resp:
        request_id = resp.headers["x-adaptive-spec-request-id"]
        raw = resp.read()
    record = next(r for r in proxy.requests() if r["request_id"] == request_id)
    assert record["outcome"] == "finished"
    reported = _output_tokens(raw, bool(body.get("stream")))
    assert 0 < reported <= 8
    assert record["timings"]["predicted_n"] == reported
    assert record["timings"]["prompt_n"] + record["timings"]["cache_n"] > 0


def test_other_paths_pass_through(tiny_server: LlamaServer, proxy: ProxyProcess) -> None:
    tokens = http_json(proxy.base + "/tokenize", {"content": "hello world"})["tokens"]
    assert tokens == http_json(tiny_server.url + "/tokenize", {"content": "hello world"})["tokens"]
    assert (
        http_json(proxy.base + "/p/x/v1/models")["data"][0]["id"]
        == http_json(tiny_server.url + "/v1/models")["data"][0]["id"]
    )
    assert http_json(proxy.base + "/props")["total_slots"] == 1
    assert isinstance(http_json(proxy.base + "/slots"), list)


def _error(url: str, data: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=data, headers=headers or {})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(req, timeout=30)
    return info.value.code, json.loads(info.value.read())


@pytest.mark.parametrize(
    ("data", "headers", "status", "code", "words"),
    [
        (b"{broken", {}, 400, "invalid_json", "not valid JSON"),
        (b'{"messages": "hi"}', {}, 400, "invalid_type", "Invalid type for 'messages'"),
        (b'{"model": "m"}', {}, 400, "missing_required_parameter", "'messages' is a required property"),
        (b'{"messages": [], "stream": 1}', {}, 400, "invalid_type", "'stream': expected a boolean"),
        (b'{"messages": []}', {"x-adaptive-spec-profile": "nope"}, 400, "unknown_profile", "known profiles: plain"),
        (b'{"messages": [], "pad": "' + b"x" * (1024 * 1024) + b'"}', {}, 413, "request_too_large", "1048576 bytes"),
    ],
)
def test_bad_input_gets_openai_shaped_errors(
    proxy: ProxyProcess, data: bytes, headers: dict[str, str], status: int, code: str, words: str
) -> None:
    got_status, body = _error(proxy.base + "/v1/chat/completions", data, headers)
    assert got_status == status
    assert set(body["error"]) >= {"message", "type", "code"}
    assert body["error"]["code"] == code
    assert words in body["error"]["message"]
    record = proxy.requests()[-1]
    assert (record["status"], record["outcome"]) == (status, "failed")


def test_attached_profiles_spec_types_are_found_for_the_router(
    tiny_server: LlamaServer, llama_server_binary: str, tiny_gguf: Any, tmp_path: Any
) -> None:
    # A fresh server shows its speculation types only after a request: the proxy asks, so the router knows which
    # attached profile drafts from n-grams, and copy-heavy work goes there from the first request.
    ngram = LlamaServer(
        llama_server_binary, tiny_gguf, "-c", "8192", "--parallel", "1", "--spec-type", "ngram-mod", log_dir=tmp_path
    )
    try:
        proc = ProxyProcess("--profile", f"plain={tiny_server.url}", "--profile", f"edits={ngram.url}")
        try:
            profiles = {p["name"]: p["spec_types"] for p in http_json(proc.base + "/adaptive/profiles")["profiles"]}
            assert "ngram-mod" in profiles["edits"] and "ngram-mod" not in profiles["plain"], profiles
            speeds = {s["profile"]: s["ngram"] for s in http_json(proc.base + "/adaptive/route")["speeds"]}
            assert speeds == {"plain": False, "edits": True}
            pasted = "```python\n" + "\n".join(f"x{i} = {i}" for i in range(30)) + "\n```\nReturn the complete file."
            body = {"model": "m", "messages": [{"role": "user", "content": pasted}], "max_tokens": 4}
            req = urllib.request.Request(
                proc.base + "/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=60) as resp:
                assert resp.headers["x-adaptive-spec-profile"] == "edits"
                assert resp.headers["x-adaptive-spec-route"] == "estimate"
        finally:
            proc.stop()
    finally:
        ngram.stop()


def test_restart_is_refused_for_attached_and_unknown_profiles(proxy: ProxyProcess) -> None:
    for name, status, code in (("plain", 409, "not_launched"), ("nope", 404, "unknown_profile")):
        req = urllib.request.Request(proxy.base + f"/adaptive/profiles/{name}/restart", method="POST")
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(req, timeout=30)
        assert caught.value.code == status
        assert json.loads(caught.value.read())["error"]["code"] == code
