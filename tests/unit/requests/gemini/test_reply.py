"""llama-server's chat answers as Gemini's: finish reasons, usageMetadata from the timings (the whole prompt, cached
tokens included), function calls, errors in Google's shape, and streams whose last chunk always carries the finish
reason, the usage and the last text, whatever the chunk splits, as Server-Sent Events or as a JSON array."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from adaptive_spec.requests.gemini.reply import (
    GeminiAnswer,
    finish_reason,
    gemini_body,
    gemini_body_bytes,
    google_error,
    usage_metadata,
)
from tests.support.gemini import sse_chunks
from tests.support.recorded import recorded

MODEL = "gemini-3.1-pro-preview"


@pytest.mark.parametrize(
    ("reason", "gemini"),
    [
        ("stop", "STOP"),
        ("tool_calls", "STOP"),
        ("length", "MAX_TOKENS"),
        ("content_filter", "SAFETY"),
        (None, "STOP"),
        ("odd", "OTHER"),
        (3, "OTHER"),
    ],
)
def test_finish_reasons_in_geminis_words(reason: Any, gemini: str) -> None:
    assert finish_reason(reason) == gemini


@pytest.mark.parametrize(
    ("timings", "usage", "metadata"),
    [
        (
            {"prompt_n": 1, "cache_n": 55, "predicted_n": 200},
            None,
            {
                "promptTokenCount": 56,
                "candidatesTokenCount": 200,
                "totalTokenCount": 256,
                "cachedContentTokenCount": 55,
            },
        ),
        (
            {"prompt_n": 9, "cache_n": 0, "predicted_n": 2},
            None,
            {"promptTokenCount": 9, "candidatesTokenCount": 2, "totalTokenCount": 11},
        ),
        (
            None,
            {"prompt_tokens": 30, "completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 20}},
            {"promptTokenCount": 30, "candidatesTokenCount": 4, "totalTokenCount": 34, "cachedContentTokenCount": 20},
        ),
        (None, None, None),
    ],
)
def test_usage_metadata_counts_the_whole_prompt(timings: Any, usage: Any, metadata: dict[str, int] | None) -> None:
    assert usage_metadata(timings, usage) == metadata


def test_a_recorded_chat_completion_becomes_a_generate_content_response() -> None:
    chat = recorded("chat_completion_ngram")
    out = gemini_body(chat, MODEL)
    candidate = out["candidates"][0]
    assert candidate["content"] == {"role": "model", "parts": [{"text": chat["choices"][0]["message"]["content"]}]}
    assert candidate["finishReason"] == "MAX_TOKENS"  # it stopped at max_tokens ("length")
    timings = chat["timings"]
    assert out["usageMetadata"] == {
        "promptTokenCount": timings["prompt_n"] + timings["cache_n"],
        "candidatesTokenCount": timings["predicted_n"],
        "totalTokenCount": timings["prompt_n"] + timings["cache_n"] + timings["predicted_n"],
        "cachedContentTokenCount": timings["cache_n"],
    }
    assert out["modelVersion"] == MODEL and out["responseId"] == chat["id"]


def _tool_answer(arguments: str) -> dict[str, Any]:
    call = {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": arguments}}
    message = {"role": "assistant", "content": "", "reasoning_content": "hm", "tool_calls": [call]}
    return {"id": "x", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": message}]}


def test_tool_calls_become_function_call_parts_with_their_ids() -> None:
    out = gemini_body(_tool_answer('{"path": "a.py"}'), MODEL)
    assert out["candidates"][0]["content"]["parts"] == [
        {"text": "hm", "thought": True},
        {"functionCall": {"name": "read_file", "args": {"path": "a.py"}, "id": "call_1"}},
    ]
    assert out["candidates"][0]["finishReason"] == "STOP"


def test_a_call_whose_arguments_are_no_object_is_a_malformed_function_call() -> None:
    out = gemini_body(_tool_answer('{"path": '), MODEL)
    assert out["candidates"][0]["finishReason"] == "MALFORMED_FUNCTION_CALL"
    assert out["candidates"][0]["content"]["parts"] == [{"text": "hm", "thought": True}]


@pytest.mark.parametrize(
    ("status", "data", "error"),
    [
        (
            400,
            b'{"error": {"code": 400, "message": "too long", "type": "exceed_context_size_error"}}',
            google_error(400, "too long"),
        ),
        (500, b"<html>oops</html>", google_error(500, "<html>oops</html>")),
        (404, b'{"detail": "nope"}', google_error(404, '{"detail": "nope"}')),
    ],
)
def test_an_error_answer_takes_googles_shape(status: int, data: bytes, error: dict[str, Any]) -> None:
    assert orjson.loads(gemini_body_bytes(status, data, MODEL)) == error


def test_googles_error_shape_names_the_status() -> None:
    assert google_error(400, "m") == {"error": {"code": 400, "message": "m", "status": "INVALID_ARGUMENT"}}
    assert google_error(401, "m")["error"]["status"] == "UNAUTHENTICATED"
    assert google_error(503, "m")["error"]["status"] == "UNAVAILABLE"
    assert google_error(502, "m")["error"]["status"] == "INTERNAL"


def _event(obj: Any) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else orjson.dumps(obj)) + b"\n\n"


def _delta(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "finish_reason": finish, "delta": delta}],
    }


TIMINGS = {"prompt_n": 12, "cache_n": 30, "predicted_n": 3}
TEXT_STREAM = b"".join(
    [
        _event(_delta({"role": "assistant", "content": None})),
        _event(_delta({"reasoning_content": "thinking"})),
        _event(_delta({"content": "Hel"})),
        _event(_delta({"content": "lo"})),
        _event(_delta({"content": "!"})),
        _event({**_delta({}, "stop"), "timings": TIMINGS}),
        _event(
            {
                "id": "chatcmpl-1",
                "choices": [],
                "usage": {"prompt_tokens": 42, "completion_tokens": 3},
                "timings": TIMINGS,
            }
        ),
        _event(b"[DONE]"),
    ]
)


def _fed(stream: bytes, answer: GeminiAnswer, cut: int) -> bytes:
    pieces = [stream[i : i + cut] for i in range(0, len(stream), cut)]
    return b"".join(answer.feed(p) for p in pieces) + answer.close()


@pytest.mark.parametrize("cut", [1, 7, 64, len(TEXT_STREAM)])
def test_a_text_stream_ends_with_a_chunk_carrying_the_finish_reason_usage_and_last_text(cut: int) -> None:
    chunks = sse_chunks(_fed(TEXT_STREAM, GeminiAnswer(MODEL, stream=True, sse=True), cut))
    parts = [c["candidates"][0]["content"]["parts"] for c in chunks]
    assert parts == [[{"text": "thinking", "thought": True}], [{"text": "Hel"}], [{"text": "lo"}], [{"text": "!"}]]
    assert [c["candidates"][0].get("finishReason") for c in chunks] == [None, None, None, "STOP"]
    assert all("usageMetadata" not in c for c in chunks[:-1])
    assert chunks[-1]["usageMetadata"] == {
        "promptTokenCount": 42,
        "candidatesTokenCount": 3,
        "totalTokenCount": 45,
        "cachedContentTokenCount": 30,
    }
    assert all(c["modelVersion"] == MODEL and c["responseId"] == "chatcmpl-1" for c in chunks)


def test_without_alt_sse_the_stream_is_one_json_array_of_the_same_chunks() -> None:
    sse = sse_chunks(_fed(TEXT_STREAM, GeminiAnswer(MODEL, stream=True, sse=True), 5))
    array = _fed(TEXT_STREAM, GeminiAnswer(MODEL, stream=True, sse=False), 5)
    assert orjson.loads(array) == sse
    assert GeminiAnswer(MODEL, stream=True).content_type == "application/json"
    assert GeminiAnswer(MODEL, stream=True, sse=True).content_type == "text/event-stream"


def test_streamed_tool_calls_go_out_whole_in_the_last_chunk() -> None:
    first = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "write_file", "arguments": ""}}
    stream = b"".join(
        [
            _event(_delta({"role": "assistant", "content": None})),
            _event(_delta({"tool_calls": [first]})),
            _event(_delta({"tool_calls": [{"index": 0, "function": {"arguments": '{"path": "a.py", '}}]})),
            _event(_delta({"tool_calls": [{"index": 0, "function": {"arguments": '"content": "x"}'}}]})),
            _event(
                _delta({"tool_calls": [{"index": 1, "id": "call_b", "function": {"name": "ls", "arguments": "{}"}}]})
            ),
            _event({**_delta({}, "tool_calls"), "timings": TIMINGS}),
            _event(b"[DONE]"),
        ]
    )
    chunks = sse_chunks(_fed(stream, GeminiAnswer(MODEL, stream=True, sse=True), 3))
    assert len(chunks) == 1
    assert chunks[0]["candidates"][0]["content"]["parts"] == [
        {"functionCall": {"name": "write_file", "args": {"path": "a.py", "content": "x"}, "id": "call_a"}},
        {"functionCall": {"name": "ls", "args": {}, "id": "call_b"}},
    ]
    assert chunks[0]["candidates"][0]["finishReason"] == "STOP"
    assert chunks[0]["usageMetadata"]["promptTokenCount"] == 42


def test_a_stream_that_said_nothing_still_ends_with_a_finish_reason() -> None:
    stream = _event(_delta({"role": "assistant", "content": None})) + _event(_delta({}, "length")) + _event(b"[DONE]")
    chunks = sse_chunks(_fed(stream, GeminiAnswer(MODEL, stream=True, sse=True), 4))
    assert chunks == [
        {
            "candidates": [{"content": {"role": "model"}, "index": 0, "finishReason": "MAX_TOKENS"}],
            "modelVersion": MODEL,
            "responseId": "chatcmpl-1",
        }
    ]


def test_an_upstream_error_event_ends_the_stream_in_googles_shape() -> None:
    error = {"error": {"code": 500, "message": "slot failed", "type": "server_error"}}
    stream = _event(_delta({"content": "a"})) + _event(_delta({"content": "b"})) + _event(error)
    answer = GeminiAnswer(MODEL, stream=True, sse=False)
    out = orjson.loads(_fed(stream, answer, 9))
    assert out[-1] == google_error(500, "slot failed")
    assert [c["candidates"][0]["content"]["parts"] for c in out[:-1]] == [[{"text": "a"}], [{"text": "b"}]]
    assert answer.ended


@pytest.mark.parametrize("sse", [True, False])
def test_a_relay_failure_ends_the_stream_with_an_error_element(sse: bool) -> None:
    answer = GeminiAnswer(MODEL, stream=True, sse=sse)
    sent = answer.feed(_event(_delta({"content": "a"})) + _event(_delta({"content": "b"})))
    sent += answer.error("the server went away", "upstream_timeout")
    chunks = sse_chunks(sent) if sse else orjson.loads(sent)
    assert [c["candidates"][0]["content"]["parts"] for c in chunks[:-1]] == [[{"text": "a"}], [{"text": "b"}]]
    assert chunks[-1] == {"error": {"code": 504, "message": "the server went away", "status": "DEADLINE_EXCEEDED"}}
    nothing = GeminiAnswer(MODEL, stream=True, sse=False)
    assert orjson.loads(nothing.error("down", "proxy_shutting_down")) == [google_error(503, "down")]
