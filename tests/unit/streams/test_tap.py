"""The relay's tap: whatever the split of the stream into chunks, the client gets the bytes it got when every event
was read and re-encoded, and the meter reads the same text, ids, timings, end and errors."""

from __future__ import annotations

import itertools
import random
from typing import Any

import orjson

from adaptive_spec.streams.meter import ResponseMeter
from adaptive_spec.streams.output import LiveText
from adaptive_spec.streams.sse import SSEParser
from adaptive_spec.streams.tap import StreamTap, cut_progress_timings
from adaptive_spec.streams.timings import without_progress_timings

# Built here, not recorded: the stream must hold what no real server gives on demand (content that looks like a
# timings field, quotes, backslashes and braces, a tool call in the middle of the text) with per-token timings
# whose every count is known.
HEAD = {"created": 1796032146, "id": "chatcmpl-9QEQ", "model": "m.gguf", "system_fingerprint": "b1", "object": "x"}


def _timings(n: int) -> dict[str, Any]:
    return {"cache_n": 3, "prompt_n": 22, "prompt_ms": 1.5, "predicted_n": n, "predicted_ms": 0.5 * n,
            "predicted_per_second": 1841.62, "draft_n": 2 * n, "draft_n_accepted": n}  # fmt: skip


def _chunk(delta: dict[str, Any], n: int | None, finish: str | None = None) -> dict[str, Any]:
    obj: dict[str, Any] = {"choices": [{"finish_reason": finish, "index": 0, "delta": delta}], **HEAD}
    if n is not None:
        obj["timings"] = _timings(n)
    return obj


def _stream(n: int = 40, *, per_token: bool = True, tool_at: int = 20) -> bytes:
    """llama-server's chat stream: a role chunk, content chunks (with per-token timings when asked), a tool-call
    delta among them, the final chunk with its timings, a usage chunk and [DONE]."""
    objs = [_chunk({"role": "assistant", "content": None}, None)]
    for i in range(n):
        text = f' t{i} "quoted" \\ {{brace}} ,"timings":{{' if i % 7 == 3 else f" t{i}"
        delta: dict[str, Any] = {"content": text}
        if i == tool_at:
            delta = {"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f", "arguments": "{}"}}]}
        objs.append(_chunk(delta, i + 1 if per_token else None))
    objs.append(_chunk({}, n, "length"))
    objs.append({"choices": [], **HEAD, "usage": {"prompt_tokens": 25, "completion_tokens": n}, "timings": _timings(n)})
    return b"".join(b"data: " + orjson.dumps(o) + b"\n\n" for o in objs) + b"data: [DONE]\n\n"


def _eager(stream: bytes, strip: bool) -> tuple[bytes, ResponseMeter]:
    """How the relay read every stream before the tap: each event parsed, re-encoded when stripping."""
    meter, parser = ResponseMeter(), SSEParser()
    events = parser.feed(stream)
    parsed = [meter.on_event(event, float(i)) for i, event in enumerate(events)]
    return (without_progress_timings(events, parsed) if strip else stream), meter


def _tapped(stream: bytes, cuts: list[int], strip: bool, meter: ResponseMeter | None = None) -> tuple[bytes, Any]:
    meter = meter or ResponseMeter()
    tap = StreamTap(meter, strip=strip)
    out = bytearray()
    edges = [0, *sorted(cuts), len(stream)]
    for k, (a, b) in enumerate(itertools.pairwise(edges)):
        out += tap.feed(stream[a:b], float(k))
    assert not tap.close()
    return bytes(out), (meter, tap)


def _same_reading(a: ResponseMeter, b: ResponseMeter) -> None:
    assert a.output.text == b.output.text
    assert a.output.tool_call_ids == b.output.tool_call_ids == ["call_1"]
    assert a.timings == b.timings and a.timings is not None
    assert a.complete and b.complete and a.error is None and b.error is None


def test_any_split_gives_the_bytes_and_the_reading_of_the_event_by_event_relay() -> None:
    rng = random.Random(7)
    for per_token in (True, False):
        stream = _stream(per_token=per_token)
        for strip in (True, False):
            want_bytes, want = _eager(stream, strip)
            splits = [[], list(range(1, len(stream), 97)), [stream.index(b"\n\n") + 1]]
            splits += [rng.sample(range(1, len(stream)), rng.randint(1, 60)) for _ in range(40)]
            for cuts in splits:
                got_bytes, (got, tap) = _tapped(stream, cuts, strip)
                assert got_bytes == want_bytes, (per_token, strip, cuts)
                _same_reading(got, want)
                # llama-server's stream is read event by event only at its start (when stripping, until timings
                # were seen to be cut as re-encoding would take them out)
                assert tap.batched == (per_token or not strip)
                if tap.batched and not cuts:  # one chunk bringing it all: read one by one only up to the switch
                    assert got.pieces == 2


def test_times_of_the_first_two_pieces_come_from_their_own_chunks() -> None:
    stream = _stream()
    events = stream.split(b"\n\n")
    cuts = list(itertools.accumulate(len(e) + 2 for e in events[:-2]))  # one event per chunk; chunk k arrives at k
    _, (meter, _) = _tapped(stream, cuts, strip=True)
    assert (meter.first_token_ms, meter.second_token_ms) == (1.0, 2.0)


def test_timings_are_cut_only_from_unfinished_chunks_whose_flat_timings_close_them() -> None:
    plain = orjson.dumps(_chunk({"content": "a"}, 3))
    assert cut_progress_timings(plain) == orjson.dumps(_chunk({"content": "a"}, None))
    assert cut_progress_timings(b"data: " + plain) == b"data: " + orjson.dumps(_chunk({"content": "a"}, None))
    assert cut_progress_timings(orjson.dumps(_chunk({}, 3, "stop"))) is None  # the final chunk keeps them
    nested = {"type": "response.output_text.delta", "response": {"finish_reason": None, "timings": _timings(1)}}
    assert cut_progress_timings(orjson.dumps(nested)) is None  # not closing the event: never a broken brace
    first = orjson.dumps({"timings": _timings(1), "choices": [{"finish_reason": None, "delta": {}}]})
    assert cut_progress_timings(first) is None


def test_a_stream_whose_timings_cannot_be_cut_is_read_event_by_event() -> None:
    objs = [{"timings": _timings(i), **_chunk({"content": f" t{i}"}, None)} for i in range(10)]
    stream = b"".join(b"data: " + orjson.dumps(o) + b"\n\n" for o in objs) + b"data: [DONE]\n\n"
    want_bytes, want = _eager(stream, True)
    got_bytes, (got, tap) = _tapped(stream, list(range(50, len(stream), 50)), True)
    assert got_bytes == want_bytes and b'"timings"' not in got_bytes and not tap.batched
    assert got.output.text == want.output.text and got.timings == want.timings and got.timings is not None


def test_a_responses_stream_is_read_the_general_way_after_its_start() -> None:
    events = [("response.created", {"type": "response.created", "response": {"id": "r"}})]
    events += [
        ("response.output_text.delta", {"type": "response.output_text.delta", "delta": f" w{i}"}) for i in range(30)
    ]
    done = {"type": "response.completed", "response": {"usage": {"input_tokens": 5}, "timings": _timings(30)}}
    events.append(("response.completed", done))
    stream = b"".join(b"event: " + n.encode() + b"\ndata: " + orjson.dumps(o) + b"\n\n" for n, o in events)
    _, want = _eager(stream, False)
    got_bytes, (got, tap) = _tapped(stream, list(range(33, len(stream), 33)), False)
    assert got_bytes == stream and tap.batched
    assert got.output.text == want.output.text == "".join(f" w{i}" for i in range(30))
    assert got.complete and got.timings == want.timings and got.timings is not None


def test_an_error_after_the_start_is_still_read() -> None:
    stream = _stream(10).replace(b"data: [DONE]", b'data: {"error":{"message":"slot gone"}}')
    _, (meter, tap) = _tapped(stream, [200, 400, 900], False)
    assert tap.batched and meter.error == "slot gone" and not meter.complete


def test_a_stream_cut_in_the_middle_of_an_event_is_told_apart() -> None:
    stream = _stream(10)
    for strip in (True, False):
        for end in (len(stream) - 5, stream.rindex(b"\n\ndata: {") + 9):
            meter = ResponseMeter()
            tap = StreamTap(meter, strip=strip)
            for a in range(0, end, 120):
                tap.feed(stream[a : min(a + 120, end)], 0.0)
            assert tap.batched and tap.close(), (strip, end)


def test_a_long_answer_is_read_a_block_at_a_time() -> None:
    stream = _stream(9000, tool_at=5)
    _, want = _eager(stream, False)
    meter = ResponseMeter()
    tap = StreamTap(meter, strip=False)
    for a in range(0, len(stream), 4096):
        tap.feed(stream[a : a + 4096], 0.0)
        assert sum(len(c) for c in meter._kept) <= 1024 * 1024 + 4096
    assert not tap.close()
    assert meter.output.text == want.output.text and meter.timings == want.timings


def test_live_text_and_crlf_streams() -> None:
    stream = _stream(12)
    live = ResponseMeter()
    live.live = LiveText()
    _, (_, tap) = _tapped(stream, [300, 700], False, live)
    assert not tap.batched and "t11" in "".join(t for t, _ in live.live.take())
    crlf = stream.replace(b"\n", b"\r\n")
    _, want = _eager(crlf, False)
    got_bytes, (got, _) = _tapped(crlf, list(range(64, len(crlf), 64)), False)
    assert got_bytes == crlf and got.output.text == want.output.text and got.timings == want.timings


def test_odd_streams_after_the_switch_read_and_strip_as_event_by_event() -> None:
    """Found in review: a CRLF stream while stripping (was held back whole and called truncated), a comment line after
    the end marker (was called an event cut off), an event whose data spans lines (kept its timings), and a data line
    holding two JSON objects (was read as two events)."""
    base = _stream(12)
    tail_objs = [_chunk({"content": " late"}, 13)]
    two_lines = b"data: " + orjson.dumps(tail_objs[0])[:40] + b"\ndata: " + orjson.dumps(tail_objs[0])[40:] + b"\n\n"
    doubled = b"data: " + orjson.dumps(_chunk({"content": "X"}, 14)) + b"," + orjson.dumps(_chunk({"content": "Y"}, 15))
    streams = {
        "crlf": base.replace(b"\n", b"\r\n"),
        "comment after [DONE]": base + b": keep-alive\n",
        "data over two lines": base.replace(b"data: [DONE]\n\n", two_lines + b"data: [DONE]\n\n"),
        "two objects in one data line": base.replace(b"data: [DONE]\n\n", doubled + b"\n\ndata: [DONE]\n\n"),
    }
    for name, stream in streams.items():
        for strip in (True, False):
            want_bytes, want = _eager(stream, strip)
            for cuts in ([], list(range(60, len(stream), 60)), [len(stream) - 3]):
                meter = ResponseMeter()
                tap = StreamTap(meter, strip=strip)
                out = bytearray()
                for k, (a, b) in enumerate(itertools.pairwise([0, *cuts, len(stream)])):
                    out += tap.feed(stream[a:b], float(k))
                assert not tap.close(), (name, strip, cuts)
                if not (strip and name.startswith("two objects")):  # not JSON: passed on either way, cut or not
                    assert bytes(out) == want_bytes, (name, strip, cuts)
                assert meter.output.text == want.output.text and meter.timings == want.timings, (name, strip)
                assert meter.complete and meter.error is None


def test_plain_text_chunks_read_in_one_pass_agree_with_reading_each_event() -> None:
    """Plain text chunks are read by one regular expression and one decode of their strings: texts that look like the
    chunk's own syntax, escapes, a key's name as the whole text, and other events among them (a tool call, an error,
    `[DONE]` in the middle, a line that is not JSON, a number) read as reading each event does."""
    texts = ['"}}],"created":1,', "\\", '\\"', "usage", "\u00e9\u4e2d\U0001f600", "\\u00e9", "", "\n\n", "data: x", "}"]
    objs: list[dict[str, Any] | bytes] = [_chunk({"role": "assistant", "content": None}, None)]
    for i, text in enumerate(texts * 3):
        objs.append(_chunk({"content": text}, i + 1 if i % 2 else None))
        if i == 7:
            objs.append(_chunk({"tool_calls": [{"index": 0, "id": "call_1", "function": {"name": "f"}}]}, None))
        if i == 12:
            objs += [b"[DONE]", b"not json", b"5", b'{"error": {"message": "late"}}']
    objs.append(_chunk({}, 99, "stop"))
    stream = b"".join(b"data: " + (o if isinstance(o, bytes) else orjson.dumps(o)) + b"\n\n" for o in objs)
    want = ResponseMeter()
    for k, event in enumerate(SSEParser().feed(stream)):
        want.on_event(event, float(k))
    for cuts in ([], list(range(50, len(stream), 50)), [len(stream) // 2]):
        meter = ResponseMeter()
        for a, b in itertools.pairwise([0, *cuts, len(stream)]):
            meter.keep(stream[a:b])
        # The call reads as the model wrote it, closed where the text goes on.
        every = texts * 3
        read = "".join(every[:8]) + '\n{"name": "f", "arguments": }' + "".join(every[8:])
        assert meter.output.text == want.output.text == read
        assert meter.output.tool_call_ids == ["call_1"]
        assert meter.timings == want.timings and meter.timings is not None and meter.timings.predicted_n == 99
        assert meter.error == want.error == "late" and meter.complete


def test_llama_servers_plain_chunks_take_the_one_pass_read() -> None:
    stream = _stream(30, per_token=True, tool_at=-1)
    body = stream[: stream.rindex(b"\n\ndata: [DONE]")]
    meter = ResponseMeter()
    assert meter._read_plain(body, body.count(b"\n\ndata: ") + 1)
    _, want = _eager(stream, strip=False)
    assert meter.output.text == want.output.text and meter.timings == want.timings


def test_plain_chunks_that_are_not_json_or_name_timings_without_them_read_as_each_event_does() -> None:
    """Found in review: a last chunk whose bytes said `"timings"` without a timings object hid the earlier chunk's;
    a chunk whose ending was not JSON had its text counted."""
    head = b'data: {"choices":[{"finish_reason":null,"index":0,"delta":{"content":"'
    streams = [
        head + b'a"}}],"id":"x","timings":{"predicted_n":5}}\n\n' + head + b'b"}}],"id":"x","timings":null}\n\n',
        head + b'a"}}],"id":"x","timings":{"predicted_n":5}}\n\n' + head + b'b"}}],"model":"timings"}\n\n',
        head + b'a"}}],"id":"x"}\n\n' + head + b'b"}}],"id":"x",}\n\n' + head + b'c"}}],"id":"x"}\n\n',
    ]
    for stream in streams:
        kept, each = ResponseMeter(), ResponseMeter()
        kept.keep(stream)
        for event in SSEParser().feed(stream):
            each.on_event(event, 0.0)
        assert (kept.output.text, kept.timings) == (each.output.text, each.timings), stream
