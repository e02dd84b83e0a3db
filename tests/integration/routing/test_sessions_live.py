"""Sessions through the proxy on a REAL llama-server: grouping by reply echo, and the per-session statistics."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.support.processes.servers import LlamaServer, ProxyProcess, http_json


@pytest.fixture(scope="module")
def proxy(tiny_server: LlamaServer) -> Iterator[ProxyProcess]:
    proc = ProxyProcess("--profile", f"plain={tiny_server.url}")
    yield proc
    proc.stop()


def _sessions(proxy: ProxyProcess) -> dict[str, Any]:
    result: dict[str, Any] = http_json(proxy.base + "/adaptive/sessions?drain=1")
    return result


def test_a_client_without_ids_is_one_session_with_statistics(proxy: ProxyProcess) -> None:
    client = openai.OpenAI(base_url=proxy.base + "/p/echo/v1", api_key="x", max_retries=0, timeout=60)
    history: list[ChatCompletionMessageParam] = [{"role": "system", "content": "You edit files."}]
    ids = []
    for turn in range(3):
        history.append({"role": "user", "content": f"turn {turn}: return the file with one more line"})
        stream = client.chat.completions.create(model="m", messages=history, max_tokens=40, temperature=0, stream=True)
        reply = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        history.append({"role": "assistant", "content": reply})
        record = proxy.requests()[-1]
        ids.append((record["session_id"], record["session_source"]))
        _sessions(proxy)  # each turn folded before the next, as an agent's tool call gives it time to be
    assert ids[0][1] == "new"
    assert {sid for sid, _ in ids} == {ids[0][0]}
    assert [source for _, source in ids[1:]] == ["echo:reply", "echo:reply"]
    report = _sessions(proxy)
    # The attached llama-server runs on this machine: its own GGUF's vocabulary is read here (no HTTP per text).
    assert report["tokenizer"] == "gguf:tiny-random-llama.gguf" and "estimate" in report["note"]
    session = next(s for s in report["sessions"] if s["session_id"] == ids[0][0])
    assert session["turns"] == 3 and session["project"] == "echo"
    turns = session["last_turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    assert all(t["output_tokens"] > 0 for t in turns)
    # Turn 1 indexes the system prompt and the first message; later turns only their one new user message.
    assert turns[0]["new_prompt_tokens"] > turns[1]["new_prompt_tokens"] > 0
    assert session["est_accepted_share_ewma"] is not None


def test_the_profiles_tokenize_endpoint_when_asked(tiny_server: LlamaServer) -> None:
    proc = ProxyProcess("--profile", f"plain={tiny_server.url}", "--tokenizer", "endpoint")
    try:
        client = openai.OpenAI(base_url=proc.base + "/v1", api_key="x", max_retries=0, timeout=60)
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "count to five"}], max_tokens=20, temperature=0
        )
        report = _sessions(proc)
        assert report["tokenizer"] == f"endpoint:{tiny_server.url}/tokenize"
        (session,) = report["sessions"]
        assert session["turns"] == 1 and session["last_turns"][0]["output_tokens"] > 0
    finally:
        proc.stop()


def test_explicit_session_headers_win(proxy: ProxyProcess) -> None:
    client = openai.OpenAI(base_url=proxy.base + "/v1", api_key="x", max_retries=0, timeout=60)
    for _ in range(2):
        client.chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            extra_headers={"x-session-id": "ses_T"},
        )
    records = proxy.requests()[-2:]
    assert [(r["session_id"], r["session_source"]) for r in records] == [("ses_T", "header:x-session-id")] * 2


def test_subagent_requests_are_marked_under_their_parent(proxy: ProxyProcess) -> None:
    client = openai.OpenAI(base_url=proxy.base + "/v1", api_key="x", max_retries=0, timeout=60)
    client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "look it up"}],
        max_tokens=4,
        extra_headers={"x-parent-session-id": "ses_parent"},
    )
    record = proxy.requests()[-1]
    assert (record["session_id"], record["subagent"]) == ("ses_parent", True)
