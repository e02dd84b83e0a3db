"""On the real Qwen 0.5B with n-gram drafting: what the TUI shows for a session equals the sums over
/adaptive/requests, which equal llama-server's own counters; and the live text it shows is the answer's text, with
accepted-draft pieces marked."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from adaptive_spec.tui.app import make_app
from tests.support.processes.servers import ProxyProcess
from tests.support.sse import stream_events
from tests.support.waiting import turns, until

FILE = "\n".join(f"def item_{i}(price: float) -> float:\n    return price * {i} + {i % 7}\n" for i in range(24))
EDIT = f"Here is prices.py:\n```python\n{FILE}```\nRename `price` to `amount` everywhere. Output the whole file."


@pytest.fixture(scope="module")
def watched(qwen_gguf: Path, llama_server_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    state = tmp_path_factory.mktemp("state")
    args = ("--threads", "1", "--ctx-size", "4096", "--feed-content")
    proxy = ProxyProcess(*args, env={"ADAPTIVE_SPEC_STATE_DIR": str(state)})
    yield proxy
    proxy.stop()


def _counters(proxy: ProxyProcess) -> tuple[float, float]:
    req = urllib.request.Request(proxy.base + "/metrics", headers={"x-adaptive-spec-profile": "iterative"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        values = dict(line.rsplit(" ", 1) for line in resp.read().decode().splitlines() if line[:1] != "#")
    return (
        float(values["llamacpp:spec_decode_num_draft_tokens_total"]),
        float(values["llamacpp:spec_decode_num_accepted_tokens_total"]),
    )


def _stream(proxy: ProxyProcess) -> str:
    body = {"messages": [{"role": "user", "content": EDIT}], "temperature": 0, "max_tokens": 300, "stream": True}
    headers = {"Content-Type": "application/json", "x-session-id": "edits", "x-adaptive-spec-profile": "iterative"}
    req = urllib.request.Request(proxy.base + "/v1/chat/completions", json.dumps(body).encode(), headers)
    text = []
    with urllib.request.urlopen(req, timeout=600) as resp:
        for event in stream_events(resp):
            if event.data.startswith("{"):
                for choice in json.loads(event.data).get("choices") or []:
                    text.append((choice.get("delta") or {}).get("content") or "")
    return "".join(text)


@pytest.mark.asyncio(loop_scope="function")
async def test_session_figures_equal_records_and_llama_server_counters(watched: ProxyProcess) -> None:
    before = await asyncio.to_thread(_counters, watched)
    app = make_app(url=watched.base, frame_s=0.1)
    async with app.run_test(size=(120, 36)):
        await until(lambda: app.connected, "the feed")
        texts = [await asyncio.to_thread(_stream, watched) for _ in range(2)]
        await until(lambda: turns(app, "edits") == 2, "both turns in the view")
        view = app.dashboard.sessions["edits"]
        last = view.last_text
        pieces = list(last.text) if last is not None else []
    after = await asyncio.to_thread(_counters, watched)
    records = [r for r in watched.requests() if r["session_id"] == "edits"]
    assert len(records) == len(view.turns) == 2
    drafted = sum(r["timings"]["draft_n"] for r in records)
    accepted = sum(r["timings"]["draft_n_accepted"] for r in records)
    assert accepted > 0, records
    assert (view.draft_n, view.draft_n_accepted) == (drafted, accepted)
    assert (after[0] - before[0], after[1] - before[1]) == (drafted, accepted)
    assert app.dashboard.profiles["iterative"].draft_n_accepted == accepted
    # the live text: what the feed carried is the answer the client got, some of it marked as drafted
    assert "".join(text for text, _ in pieces) == texts[-1]
    assert any(drafted for _, drafted in pieces) and not all(drafted for _, drafted in pieces)
