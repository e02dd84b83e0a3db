"""The read timeout is silence from the server, not a wait in its queue, on a REAL llama-server (tiny model, one
slot): a request sent while the server is answering a long one waits its turn and is answered, even when its turn
comes later than `--read-timeout`; a stopped server still times out (test_faults_live.py)."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections.abc import Iterator

import pytest

from tests.support.processes.servers import LlamaServer, ProxyProcess

READ_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def proxy(tiny_server: LlamaServer) -> Iterator[ProxyProcess]:
    proc = ProxyProcess("--profile", f"plain={tiny_server.url}", "--read-timeout", str(READ_TIMEOUT_S))
    yield proc
    proc.stop()


def _post(proxy: ProxyProcess, body: dict[str, object]) -> urllib.request.Request:
    return urllib.request.Request(
        proxy.base + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )


def test_a_request_queued_behind_a_long_answer_waits_its_turn(proxy: ProxyProcess) -> None:
    long_answer = {
        "model": "m",
        "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 6000,
        "ignore_eos": True,
        "stream": True,
    }
    started = threading.Event()
    streamed: list[float] = []

    def stream() -> None:
        with urllib.request.urlopen(_post(proxy, long_answer), timeout=120) as resp:
            for line in resp:
                if line.startswith(b"data: {"):
                    started.set()
            streamed.append(time.monotonic())

    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60), "the long answer never started"
    t0 = time.monotonic()
    short = {"model": "m", "messages": [{"role": "user", "content": "Hi."}], "max_tokens": 4}
    with urllib.request.urlopen(_post(proxy, short), timeout=120) as resp:
        status, answer = resp.status, json.loads(resp.read())
    waited = time.monotonic() - t0
    reader.join(120)
    assert status == 200 and answer["choices"], answer
    # It did wait its turn, longer than the read timeout: before, that was a 504 "did not answer within 2.0 s".
    assert waited > 1.5 * READ_TIMEOUT_S, f"the long answer ended too soon to queue the short one ({waited:.1f} s)"
    assert streamed and streamed[0] - t0 <= waited + 1.0  # its turn came when the long answer ended


def test_an_answer_sent_whole_after_more_than_the_read_timeout_is_waited_for(proxy: ProxyProcess) -> None:
    """No stream: llama-server sends nothing until the whole answer is made, which on a slow machine (or a long
    answer) takes longer than `--read-timeout`; llama-server sets no limit there, and the proxy is not stricter
    while the server is at work (its /slots shows the slot processing). Before, a 504 after the read timeout."""
    long_answer = {
        "model": "m",
        "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 8000,
        "ignore_eos": True,
    }
    t0 = time.monotonic()
    with urllib.request.urlopen(_post(proxy, long_answer), timeout=300) as resp:
        status, answer = resp.status, json.loads(resp.read())
    waited = time.monotonic() - t0
    assert status == 200 and answer["usage"]["completion_tokens"] > 0, answer
    assert waited > 1.5 * READ_TIMEOUT_S, f"the answer came too soon to show the wait ({waited:.1f} s)"
