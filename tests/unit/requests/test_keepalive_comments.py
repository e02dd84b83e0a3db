"""Where a server's stream begins to answer: past the SSE comments llama-server b11549 sends while it prefills
(requests/forwarding/keepalive.py `past_comments`), so the proxy's keep-alives go on until then."""

from __future__ import annotations

from adaptive_spec.requests.forwarding.keepalive import past_comments

EVENT = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null}}]}\n\n'


def test_comments_alone_are_no_answer() -> None:
    assert past_comments(b":\n\n") == (b"", False)
    assert past_comments(b":\n\n:\n\n: keep-alive\r\n\r\n") == (b"", False)
    assert past_comments(b"") == (b"", False)


def test_a_comment_line_not_yet_whole_is_kept_to_be_read_on() -> None:
    assert past_comments(b":\n\n: ping") == (b": ping", False)
    assert past_comments(b": ping" + b"\n\n") == (b"", False)


def test_the_answer_begins_at_the_first_line_that_is_no_comment() -> None:
    assert past_comments(b":\n\n" + EVENT) == (EVENT, True)
    assert past_comments(b"\r\n:\r\n\r\nevent: message_start\n") == (b"event: message_start\n", True)
    assert past_comments(b"d") == (b"d", True)  # an event's first byte is enough


def test_comments_after_the_first_event_are_the_streams_own() -> None:
    assert past_comments(EVENT + b":\n\n") == (EVENT + b":\n\n", True)
