"""Every count the proxy shows equals llama-server's own: over the same window, the records' summed prompt, cached,
predicted, drafted and accepted tokens equal the differences of llama-server's `/metrics` counters — over every API
the proxy speaks (chat, completions, responses, Anthropic messages, Gemini), streamed and not, with tools, a client
that hangs up mid-stream, and a request answered after a head restore — and the proxy's own `/metrics` equals its
records. A real llama-server (the tiny model: fast enough to make a hung-up stream still decoding)."""

from __future__ import annotations

import http.client
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.processes.servers import LlamaServer, ProxyProcess, http_json, http_text, wait_until

COUNTERS = {
    "prompt_n": "llamacpp:prompt_tokens_total",
    "cache_n": "llamacpp:prompt_tokens_cached_total",
    "predicted_n": "llamacpp:tokens_predicted_total",
    "draft_n": "llamacpp:spec_decode_num_draft_tokens_total",
    "draft_n_accepted": "llamacpp:spec_decode_num_accepted_tokens_total",
}
PROXY_COUNTERS = {
    "prompt_n": "adaptive_spec_prompt_tokens_total",
    "cache_n": "adaptive_spec_cached_prompt_tokens_total",
    "predicted_n": "adaptive_spec_predicted_tokens_total",
    "draft_n": "adaptive_spec_draft_tokens_total",
    "draft_n_accepted": "adaptive_spec_draft_accepted_tokens_total",
}
# A head's worth of system prompt (over MIN_HEAD_TOKENS on the tiny model's vocabulary).
SYSTEM = "You are a synthetic coding agent. " + " ".join(f"Rule {i}: keep file_{i}.py tested." for i in range(80))
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }
]


def _llama_metrics(url: str) -> dict[str, float]:
    out = {}
    for line in http_text(url + "/metrics").splitlines():
        if line.startswith("llamacpp:") and " " in line:
            name, value = line.split()
            out[name] = float(value)
    return out


def _proxy_metrics(proxy: ProxyProcess) -> dict[str, float]:
    totals: dict[str, float] = {}
    for line in http_text(proxy.base + "/metrics").splitlines():
        if line.startswith("adaptive_spec_") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            base = name.split("{", 1)[0]
            totals[base] = totals.get(base, 0.0) + float(value)
    return totals


def _post(proxy: ProxyProcess, path: str, body: dict[str, Any], **headers: str) -> bytes:
    req = urllib.request.Request(
        proxy.base + path, json.dumps(body).encode(), {"Content-Type": "application/json", **headers}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert 200 <= resp.status < 300
        return bytes(resp.read())


# A streamed request a client leaves after its first chunks, while llama-server is still decoding it.
ENDLESS = {
    "model": "m",
    "stream": True,
    "max_tokens": 200_000,
    "ignore_eos": True,
    "messages": [{"role": "user", "content": "Count for ever."}],
}


def _hang_up_mid_stream(proxy: ProxyProcess) -> None:
    """A streamed request the client leaves after its first chunks, while llama-server is still decoding."""
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps(ENDLESS), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    got = b""
    while got.count(b"data: ") < 20:
        got += resp.read1(4096)
    conn.close()  # the client hangs up


@pytest.fixture(scope="module")
def proxy(tiny_server: LlamaServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    home = tmp_path_factory.mktemp("counts")
    env = {"ADAPTIVE_SPEC_STATE_DIR": str(home / "state"), "ADAPTIVE_SPEC_CONFIG_DIR": str(home / "config")}
    slots = tiny_server.log_path.parent  # the fixture's --slot-save-path: heads are saved and restored through it
    proc = ProxyProcess(
        "--profile", f"plain={tiny_server.url}", "--slot-dir", str(slots), "--tokenizer", "off", env=env
    )
    yield proc
    proc.stop()


def _settled(proxy: ProxyProcess, tiny_server: LlamaServer) -> None:
    wait_until(lambda: http_json(proxy.base + "/adaptive/heads")["pending"] == 0, 60, "the head store to settle")
    wait_until(lambda: not tiny_server.slot_busy(), 60, "llama-server to be idle")


def test_the_records_count_what_llama_server_counted_on_every_api(
    tiny_server: LlamaServer, proxy: ProxyProcess, tmp_path: Path
) -> None:
    _settled(proxy, tiny_server)
    before, seen = _llama_metrics(tiny_server.url), {r["request_id"] for r in proxy.requests()}
    chat = {"model": "m", "max_tokens": 6, "messages": [{"role": "user", "content": "Say hi."}]}
    for stream in (False, True):
        _post(proxy, "/v1/chat/completions", {**chat, "stream": stream})
        _post(proxy, "/v1/chat/completions", {**chat, "stream": stream, "tools": TOOLS, "tool_choice": "auto"})
        _post(proxy, "/v1/completions", {"model": "m", "prompt": "def f():", "max_tokens": 6, "stream": stream})
        _post(proxy, "/v1/responses", {"model": "m", "input": "Say hi.", "max_output_tokens": 6, "stream": stream})
        _post(proxy, "/v1/messages", {**chat, "stream": stream})
        gemini = {"contents": [{"role": "user", "parts": [{"text": "Say hi."}]}]}
        verb = "streamGenerateContent?alt=sse" if stream else "generateContent"
        _post(proxy, f"/v1beta/models/gemini-local:{verb}", {**gemini, "generationConfig": {"maxOutputTokens": 6}})
    _hang_up_mid_stream(proxy)
    # A head: session one's first turn is saved; session two, new, starts from it (a restore, then its request).
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Write a.py."}]
    _post(proxy, "/v1/chat/completions", {**chat, "messages": first}, **{"x-session-id": "one"})
    wait_until(lambda: http_json(proxy.base + "/adaptive/heads")["counts"]["saved"] >= 1, 60, "the head's save")
    second = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Write b.py."}]
    _post(proxy, "/v1/chat/completions", {**chat, "messages": second}, **{"x-session-id": "two"})
    _settled(proxy, tiny_server)

    def window() -> list[dict[str, Any]]:
        return [r for r in proxy.requests() if r["request_id"] not in seen]

    # Answers not seen to their end (the hung-up stream; Anthropic's and Responses' usage without timings) are
    # counted again from llama-server's counters once it is quiet: the event waited for is the hung-up record's.
    wait_until(
        lambda: any(r["status"] == 499 and r["timings"] for r in window()), 30, "the hung-up request to be counted"
    )
    records = window()
    assert len(records) == 2 * 6 + 1 + 2, [(r["path"], r["status"]) for r in records]
    restored = [r for r in records if r["session_id"] == "two"]
    assert restored and restored[0]["timings"]["cache_n"] > 0, restored  # answered from the restored head
    hung = [r for r in records if r["status"] == 499 or r["outcome"] == "failed"]
    assert len(hung) == 1 and hung[0]["timings"] is not None, hung  # what llama-server did for it, counted
    assert hung[0]["timings"]["predicted_n"] >= 19, hung  # at least the tokens its client read, more after the cancel
    after = _llama_metrics(tiny_server.url)
    ours = {field: sum(int((r["timings"] or {}).get(field, 0)) for r in records) for field in COUNTERS}
    theirs = {field: int(after[name] - before.get(name, 0.0)) for field, name in COUNTERS.items()}
    assert ours == theirs, (ours, theirs)

    # The proxy's /metrics: the sums of all its records (since it started).
    every = proxy.requests()
    totals = _proxy_metrics(proxy)
    for field, name in PROXY_COUNTERS.items():
        assert totals.get(name, 0) == sum(int((r["timings"] or {}).get(field, 0)) for r in every), (name, totals)


def test_from_a_drafting_servers_start_every_counter_adds_up_drafts_included(
    llama_server_binary: str, qwen_gguf: Path, tmp_path: Path
) -> None:
    """From a fresh n-gram server's first request on (the proxy's own at start included: none here, the patched
    server says its types in /props), the records add up to every one of its counters, drafts included: the real
    Qwen 0.5B copying pasted text, which the n-gram drafter drafts."""
    server = LlamaServer(
        llama_server_binary, qwen_gguf, "-c", "4096", "--metrics", "--spec-type", "ngram-mod", log_dir=tmp_path
    )
    env = {"ADAPTIVE_SPEC_STATE_DIR": str(tmp_path / "state"), "ADAPTIVE_SPEC_CONFIG_DIR": str(tmp_path / "config")}
    proxy = ProxyProcess("--profile", f"ngram={server.url}", "--tokenizer", "off", env=env)
    try:
        pasted = "Repeat this code exactly:\n" + "\n".join(f"value_{i} = {i} * {i}" for i in range(12))
        for stream in (False, True):
            messages = [{"role": "user", "content": pasted}]
            body = {"model": "m", "max_tokens": 48, "temperature": 0, "stream": stream, "messages": messages}
            _post(proxy, "/v1/chat/completions", body)
            _post(proxy, "/v1/messages", body)  # usage, no timings: counted from the server's counters
        wait_until(lambda: not server.slot_busy(), 60, "llama-server to be idle")

        def sums() -> tuple[dict[str, int], dict[str, int]]:
            metrics = _llama_metrics(server.url)
            records = proxy.requests()
            return (
                {f: sum(int((r["timings"] or {}).get(f, 0)) for r in records) for f in COUNTERS},
                {f: int(metrics.get(name, 0)) for f, name in COUNTERS.items()},
            )

        try:
            wait_until(lambda: sums()[0] == sums()[1], 30, "the records to add up to llama-server's counters")
        except AssertionError:
            raise AssertionError((sums(), [(r["api"], r["stream"], r["timings"]) for r in proxy.requests()])) from None
        ours, _ = sums()
        assert ours["draft_n"] > 0, ours  # the n-gram drafter drafted: the comparison covers drafts
    finally:
        proxy.stop()
        server.stop()
