from __future__ import annotations

from typing import Any

import orjson

from adaptive_spec.streams.meter import ResponseMeter
from adaptive_spec.streams.output import event_output
from adaptive_spec.streams.sse import SSEEvent
from adaptive_spec.streams.timings import chat_delta_text, find_timings, generated_pieces
from adaptive_spec.telemetry.records import Timings
from tests.support.recorded import recorded

# A real answer's timings, n-gram drafting, the prompt mostly cached: every count in it is non-zero.
TIMINGS: dict[str, Any] = recorded("chat_completion_ngram")["timings"]


def test_timings_with_drafts() -> None:
    assert TIMINGS["draft_n"] > 0 and TIMINGS["cache_n"] > 0
    assert find_timings({"timings": TIMINGS}) == Timings(
        prompt_n=TIMINGS["prompt_n"],
        cache_n=TIMINGS["cache_n"],
        predicted_n=TIMINGS["predicted_n"],
        prompt_ms=TIMINGS["prompt_ms"],
        predicted_ms=TIMINGS["predicted_ms"],
        predicted_per_second=TIMINGS["predicted_per_second"],
        draft_n=TIMINGS["draft_n"],
        draft_n_accepted=TIMINGS["draft_n_accepted"],
    )


def test_absent_draft_fields_mean_zero() -> None:
    plain = recorded("chat_completion_prefill")["timings"]  # a server that does not draft sends no draft fields
    assert not [k for k in plain if k.startswith("draft")]
    found = find_timings({"timings": plain})
    assert found is not None
    assert (found.draft_n, found.draft_n_accepted) == (0, 0)


def test_nested_timings_for_responses_and_messages() -> None:
    assert find_timings({"type": "response.completed", "response": {"timings": TIMINGS}}) is not None
    assert find_timings({"type": "message_start", "message": {"timings": TIMINGS}}) is not None
    assert find_timings({"choices": []}) is None


def test_generated_pieces_per_api() -> None:
    assert generated_pieces({"choices": [{"delta": {"role": "assistant", "content": None}}]}) == 0
    assert generated_pieces({"choices": [{"delta": {"content": "hi"}}]}) == 1
    assert generated_pieces({"choices": [{"delta": {"reasoning_content": "hm"}}]}) == 1
    assert generated_pieces({"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]}) == 1
    assert generated_pieces({"choices": [{"text": "x", "index": 0}]}) == 1
    assert generated_pieces({"choices": [{"text": "", "index": 0}]}) == 0
    assert generated_pieces({"type": "response.output_text.delta", "delta": "x"}) == 1
    assert generated_pieces({"type": "response.created", "response": {}}) == 0
    assert generated_pieces({"type": "content_block_delta", "delta": {"type": "text_delta", "text": "x"}}) == 1
    assert generated_pieces({"type": "content_block_delta", "delta": {"type": "text_delta", "text": ""}}) == 0
    assert generated_pieces({"content": "x", "stop": False}) == 1


def _event(obj: object) -> SSEEvent:
    return SSEEvent("", orjson.dumps(obj).decode())


def test_meter_first_and_second_token_times() -> None:
    meter = ResponseMeter()
    meter.on_event(_event({"choices": [{"delta": {"role": "assistant", "content": None}}]}), 5.0)
    meter.on_event(_event({"choices": [{"delta": {"content": "a"}}]}), 10.0)
    meter.on_event(_event({"choices": [{"delta": {"content": "b"}}]}), 25.0)
    meter.on_event(_event({"choices": [{"delta": {"content": "c"}}]}), 30.0)
    meter.on_event(_event({"choices": [], "timings": TIMINGS}), 31.0)
    meter.on_event(SSEEvent("", "[DONE]"), 32.0)
    assert (meter.first_token_ms, meter.second_token_ms) == (10.0, 25.0)
    assert meter.timings is not None and meter.timings.draft_n_accepted == TIMINGS["draft_n_accepted"]
    assert meter.error is None


def test_meter_error_event_and_body() -> None:
    meter = ResponseMeter()
    meter.on_event(_event({"error": {"message": "context full", "code": 400}}), 1.0)
    assert meter.error == "context full"
    body = ResponseMeter()
    body.on_body(orjson.dumps({"choices": [{"message": {"content": "x"}}], "timings": TIMINGS}))
    assert body.timings is not None and body.timings.predicted_n == TIMINGS["predicted_n"]


def test_meter_ignores_non_json() -> None:
    meter = ResponseMeter()
    meter.on_event(SSEEvent("", "not json {"), 1.0)
    meter.on_body(b"<html>")
    assert meter.timings is None and meter.error is None


def test_anthropic_stream_falls_back_to_merged_usage() -> None:
    meter = ResponseMeter()
    start = {"type": "message_start", "message": {"usage": {"cache_read_input_tokens": 29, "input_tokens": 1}}}
    meter.on_event(_event(start), 1.0)
    meter.on_event(_event({"type": "message_delta", "usage": {"output_tokens": 3}}), 2.0)
    assert meter.timings == Timings(prompt_n=1, cache_n=29, predicted_n=3, from_usage=True)


def test_openai_usage_counts_cached_tokens_inside_prompt_tokens() -> None:
    meter = ResponseMeter()
    usage = {"prompt_tokens": 30, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 29}}
    meter.on_body(orjson.dumps({"usage": usage}))
    assert meter.timings == Timings(prompt_n=1, cache_n=29, predicted_n=5, from_usage=True)


def test_real_timings_win_over_usage() -> None:
    meter = ResponseMeter()
    meter.on_body(orjson.dumps({"usage": {"prompt_tokens": 1}, "timings": TIMINGS}))
    assert meter.timings is not None and not meter.timings.from_usage and meter.timings.draft_n == TIMINGS["draft_n"]


def test_meter_knows_when_the_stream_has_ended() -> None:
    for last in (
        SSEEvent("", "[DONE]"),
        SSEEvent("message_stop", '{"type":"message_stop"}'),
        SSEEvent("response.completed", '{"type":"response.completed"}'),
    ):
        meter = ResponseMeter()
        meter.on_event(_event({"choices": [{"delta": {"content": "a"}}]}), 1.0)
        assert not meter.complete
        meter.on_event(last, 2.0)
        assert meter.complete


def test_progress_timings_are_stripped_except_on_the_final_chunk() -> None:
    from adaptive_spec.streams.timings import without_progress_timings

    events = [
        _event({"choices": [{"delta": {"content": "a"}, "finish_reason": None}], "timings": TIMINGS}),
        _event({"choices": [{"delta": {}, "finish_reason": "stop"}], "timings": TIMINGS}),
        _event({"choices": [], "usage": {"prompt_tokens": 1}, "timings": TIMINGS}),
        SSEEvent("", "[DONE]"),
        SSEEvent("named", "not json"),
    ]
    out = without_progress_timings(events)
    chunks = out.split(b"\n\n")
    assert b"timings" not in chunks[0] and b'"content":"a"' in chunks[0]
    assert b"timings" in chunks[1] and b"timings" in chunks[2]
    assert chunks[3] == b"data: [DONE]" and chunks[4] == b"event: named\ndata: not json"


def test_the_chat_chunk_fast_path_reads_what_the_general_readers_read() -> None:
    shapes: list[dict[str, Any]] = [
        {"choices": [{"index": 0, "delta": {"content": " tok"}}]},
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": None}], "timings": {"predicted_n": 3}},
        {"choices": [{"index": 0, "delta": {"content": None}}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "think", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"id": "c1", "function": {"arguments": "{}"}}]}}]},
        {"choices": [{"index": 0, "delta": {"content": "a"}}, {"index": 1, "delta": {"content": "b"}}]},
        {"choices": [{"index": 0, "text": "legacy"}]},
        {"choices": []},
        {"type": "response.output_text.delta", "delta": "hi"},
    ]
    fast = 0
    for obj in shapes:
        text = chat_delta_text(obj)
        if text is None:
            continue
        fast += 1
        texts, ids = event_output(obj)
        assert ("".join(texts), ids, generated_pieces(obj)) == (text, [], int(bool(text))), obj
    assert fast == 3  # the plain content chunks; reasoning, tool calls, several choices and other APIs go the long way
