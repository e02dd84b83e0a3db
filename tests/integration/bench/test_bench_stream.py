"""The bench's stream reader (the proxy's SSE parser) under what a real llama-server does not send on demand: events
split across chunks at every awkward place, CRLF line ends, comments, and a 100,000-character line."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from adaptive_spec.bench.stream import stream_chat
from tests.support.fakes.fake_upstream import FakeUpstream

pytestmark = pytest.mark.asyncio(loop_scope="function")
LONG = "x" * 100_000


def _event(obj: object, end: bytes = b"\n\n") -> bytes:
    return b"data: " + orjson.dumps(obj) + end


ANSWER = (
    _event({"choices": [{"delta": {"content": "Hel"}}]}, b"\r\n\r\n")
    + _event({"choices": [{"delta": {"content": LONG}}]})
    + b": a comment\n\n"
    + _event({"choices": [{"delta": {}, "finish_reason": "stop"}], "timings": {"predicted_n": 2}})
    + b"data: [DONE]\n\n"
)


async def test_the_reader_takes_any_split_crlf_and_long_lines() -> None:
    # 7-byte pieces: every field, line end and event is split somewhere.
    fake = FakeUpstream(answer=ANSWER, piece_bytes=7, headers={"x-adaptive-spec-profile": "p"})
    async with fake, aiohttp.ClientSession() as session:
        reply = await stream_chat(session, fake.url + "/v1/chat/completions", {"stream": True})
    assert reply.text == "Hel" + LONG
    assert reply.timings == {"predicted_n": 2} and reply.finish_reason == "stop"
    assert reply.served_profile == "p" and reply.route is None
    assert reply.ttft_ms is not None and reply.ttst_ms is not None and reply.ttst_ms >= reply.ttft_ms
