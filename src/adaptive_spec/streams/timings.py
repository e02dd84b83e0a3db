"""Reading llama-server's `timings` (and usage) out of responses, streamed or not, for every API it speaks."""

from __future__ import annotations

import re
from typing import Any

import orjson

from adaptive_spec.streams.output import LiveText, OutputCollector, body_output, event_output
from adaptive_spec.streams.sse import SSEEvent, SSEParser, ends_mid_event
from adaptive_spec.telemetry.records import Timings

# Where each API puts the object that may carry `timings` / `usage`: the event itself, or a nested object.
_CONTAINERS = ("response", "message")
# The last event of a Responses-API or Anthropic stream (OpenAI chat/completions end with `data: [DONE]`).
_END_EVENTS = frozenset({"response.completed", "response.failed", "response.incomplete", "message_stop"})
# Responses-API and Anthropic stream events whose `delta` is generated text.
_DELTA_EVENT_TYPES = frozenset(
    {
        "response.output_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_summary_text.delta",
        "response.function_call_arguments.delta",
        "content_block_delta",
    }
)


def _int(value: Any) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0


def _float(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def parse_timings(raw: Any) -> Timings | None:
    """A llama-server `timings` object as a Timings; None when it is not an object."""
    if not isinstance(raw, dict):
        return None
    return Timings(
        prompt_n=_int(raw.get("prompt_n")),
        cache_n=_int(raw.get("cache_n")),
        predicted_n=_int(raw.get("predicted_n")),
        prompt_ms=_float(raw.get("prompt_ms")),
        predicted_ms=_float(raw.get("predicted_ms")),
        predicted_per_second=_float(raw.get("predicted_per_second")),
        draft_n=_int(raw.get("draft_n")),
        draft_n_accepted=_int(raw.get("draft_n_accepted")),
    )


def find_timings(obj: Any) -> Timings | None:
    """The `timings` of a response body or stream event, wherever the API nests it."""
    return parse_timings(_raw_timings(obj))


def _raw_timings(obj: Any) -> dict[str, Any] | None:
    if not isinstance(obj, dict):
        return None
    found = obj.get("timings")
    if isinstance(found, dict):
        return found
    for key in _CONTAINERS:
        inner = obj.get(key)
        if isinstance(inner, dict) and isinstance(inner.get("timings"), dict):
            return inner["timings"]  # type: ignore[no-any-return]
    return None


def find_usage(obj: Any) -> dict[str, Any] | None:
    """The `usage` object of a response or stream event (OpenAI, Responses or Anthropic shape)."""
    if not isinstance(obj, dict):
        return None
    for holder in (obj, obj.get("response"), obj.get("message")):
        if isinstance(holder, dict) and isinstance(holder.get("usage"), dict):
            usage: dict[str, Any] = holder["usage"]
            return usage
    return None


def timings_from_usage(usage: dict[str, Any]) -> Timings:
    """Token counts from `usage` when a response carries no `timings` (llama-server's Anthropic API).

    Anthropic's `input_tokens` excludes cached ones; OpenAI's `prompt_tokens` includes them. Draft counts are
    not in usage, so they read 0.
    """
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
    if "cache_read_input_tokens" in usage:
        cache_n = _int(usage.get("cache_read_input_tokens"))
        prompt_n = _int(usage.get("input_tokens"))
    else:
        cache_n = _int(details.get("cached_tokens")) if isinstance(details, dict) else 0
        prompt_n = max(0, _int(usage.get("prompt_tokens", usage.get("input_tokens"))) - cache_n)
    predicted_n = _int(usage.get("completion_tokens", usage.get("output_tokens")))
    return Timings(prompt_n=prompt_n, cache_n=cache_n, predicted_n=predicted_n, from_usage=True)


def _nonempty(value: Any) -> bool:
    return bool(value) and value is not None


def generated_pieces(obj: Any) -> int:
    """How many pieces of generated output a stream event carries (0 for role, usage or bookkeeping events)."""
    if not isinstance(obj, dict):
        return 0
    choices = obj.get("choices")
    if isinstance(choices, list):
        count = 0
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                if any(_nonempty(delta.get(k)) for k in ("content", "reasoning_content", "tool_calls")):
                    count += 1
            elif _nonempty(choice.get("text")):
                count += 1
        return count
    kind = obj.get("type")
    if isinstance(kind, str):
        if kind in _DELTA_EVENT_TYPES:
            delta = obj.get("delta")
            if isinstance(delta, dict):
                return int(any(_nonempty(v) for k, v in delta.items() if k != "type"))
            return int(_nonempty(delta))
        return 0
    # llama-server's native /completion stream: {"content": "...", "stop": false}
    return int(_nonempty(obj.get("content")) and "stop" in obj)


_PLAIN_DELTA_KEYS = frozenset(("content", "role"))


def chat_delta_text(obj: dict[str, Any]) -> str | None:
    """The text of a chat stream chunk with one choice whose delta holds a string `content` (and maybe `role`) and
    nothing else; None for any other event. Most events of a chat stream are this shape: the relay reads them here
    instead of through `event_output` and `generated_pieces`, which walk every shape."""
    choices = obj.get("choices")
    if type(choices) is not list or len(choices) != 1:
        return None
    choice = choices[0]
    delta = choice.get("delta") if type(choice) is dict else None
    if type(delta) is not dict:
        return None
    content = delta.get("content")
    if type(content) is not str or not _PLAIN_DELTA_KEYS.issuperset(delta):
        return None
    return content


class ResponseMeter:
    """Accumulates what one response tells about itself: token arrival times, timings, an upstream error.

    The caller passes a monotonic clock reading in milliseconds with each piece, so this stays free of I/O. Events
    are read one by one (`on_event`) while their arrival times matter; after that a stream's bytes may be handed
    over as they came (`keep`) and are read in one batch when the meter is asked for what they say (its output,
    timings, error or end), so the relay does nothing per chunk but pass them on.
    """

    __slots__ = (
        "_complete",
        "_error",
        "_kept",
        "_kept_size",
        "_output",
        "_pieces",
        "_raw",
        "_sse",
        "_tail",
        "_timings",
        "_usage",
        "first_token_ms",
        "live",
        "second_token_ms",
    )

    def __init__(self) -> None:
        self._output = OutputCollector()
        self.live: LiveText | None = None  # set when the live feed carries the text (serve --feed-content)
        # True once the stream's own end marker arrived: a client may hang up right after it, and lose nothing.
        self._complete = False
        # The latest event's raw `timings`, read into a Timings only when asked for (every chunk carries one when
        # per-token timings are on: parsing each cost a fifth of the relay's per-chunk work).
        self._raw: dict[str, Any] | None = None
        self._timings: Timings | None = None
        self._usage: dict[str, Any] = {}
        self.first_token_ms: float | None = None
        self.second_token_ms: float | None = None
        self._error: str | None = None
        self._pieces = 0
        self._kept: list[bytes] = []  # stream bytes handed over by `keep`, not read yet
        self._kept_size = 0
        self._tail = b""  # the kept bytes' last event, not complete yet
        self._sse: SSEParser | None = None  # reads the kept bytes once they show CR line endings

    # What the response said: reading any of these first reads the bytes kept so far.

    @property
    def output(self) -> OutputCollector:
        self._digest()
        return self._output

    @property
    def complete(self) -> bool:
        self._digest()
        return self._complete

    @property
    def error(self) -> str | None:
        """The error the server's answer carried (an error event, or an `error` object); the proxy's own verdict on
        the request is its `Outcome`."""
        self._digest()
        return self._error

    @property
    def pieces(self) -> int:
        """Pieces of generated output read one by one so far (events kept as bytes are not counted)."""
        return self._pieces

    @property
    def partial(self) -> bool:
        """The kept bytes end in the middle of an event."""
        self._digest()
        if self._sse is not None:
            return self._sse.pending
        return bool(self._tail) and ends_mid_event(self._tail)

    def on_event(self, event: SSEEvent, now_ms: float) -> dict[str, Any] | None:
        """Take in one stream event; returns its parsed JSON object (None if it is not one), so a caller that
        re-encodes the stream need not parse it again."""
        data = event.data
        if data == "[DONE]" or event.event in _END_EVENTS:
            self._complete = True
        if not data or data == "[DONE]":
            return None
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(obj, dict):
            return None
        pieces = self._absorb(obj, event.event == "error")
        if pieces:
            if self._pieces == 0:
                self.first_token_ms = now_ms
            if self._pieces <= 1 and self._pieces + pieces >= 2:
                self.second_token_ms = now_ms
            self._pieces += pieces
        return obj

    def keep(self, chunk: bytes) -> None:
        """Stream bytes to read later, in one batch: the events that follow those given to `on_event`."""
        self._kept.append(chunk)
        self._kept_size += len(chunk)
        if self._kept_size > _KEEP_LIMIT:  # a long answer is read a block at a time: memory stays bounded
            self._digest()

    def _absorb(self, obj: dict[str, Any], error_event: bool) -> int:
        """One event's object into the output, timings, usage and error; returns its pieces of generated output."""
        ids: list[str] = []
        text = chat_delta_text(obj)
        if text is not None:  # the commonest event, read in one step (the same result as the general readers)
            texts, pieces = [text], int(bool(text))
        else:
            texts, ids = event_output(obj)
            pieces = generated_pieces(obj)
        self._output.add(texts, ids)
        self._take(obj)
        if self.live is not None:
            accepted = _int(self._raw.get("draft_n_accepted")) if self._raw is not None else None
            self.live.add("".join(texts), accepted)
        if error_event or "error" in obj:
            self._error = _error_text(obj)
        return pieces

    def _digest(self) -> None:
        """Read the kept bytes' complete events (a partial last one waits for the rest)."""
        if not self._kept:
            return
        data = self._tail + b"".join(self._kept)
        self._kept, self._kept_size = [], 0
        if self._sse is not None or b"\r" in data:  # CR line endings: read as the spec says, from here on
            self._tail = b""
            self._sse = self._sse or SSEParser()
            self._read_events(self._sse.feed(data))
            return
        end = data.rfind(b"\n\n")
        if end < 0:
            self._tail = data
            return
        self._tail = data[end + 2 :]
        lines = _data_lines(data[:end])
        if lines is None:  # not one `data: ` line an event: read as the spec says
            self._read_events(SSEParser().feed(data[: end + 2]))
            return
        body, done, count = lines
        self._complete = self._complete or done
        if not self._read_plain(body, count):
            self._read_values(body, count)

    def _read_plain(self, body: bytes, count: int) -> bool:
        """The block's events by one regular expression: llama-server's plain text chunks (one choice, a delta with
        only `content`, no finish) give their text strings, decoded all at once; any other event is parsed and read
        by the general readers, in its place. False (nothing read) when the block is not that shape."""
        rows = _PLAIN_OR_OTHER.findall(body)
        if len(rows) != count:
            return False
        # A plain chunk that says more than its text is read by the general readers. A stream's plain chunks mostly
        # end alike (the same id, model and creation time): each distinct ending is looked at once.
        rests = {rest for _, rest, _ in rows}
        if any(_NOT_PLAIN_KEYS.search(rest) for rest in rests):
            return False
        # Each distinct ending must end a JSON object (an event that is not JSON says nothing): decoded once each.
        ends = [b'{"_":0,' + rest for rest in rests if rest]
        checked = _loads_bytes(b"[" + b",".join(ends) + b"]") if ends else []
        if type(checked) is not list or len(checked) != len(ends):
            return False
        strings = [content for content, rest, _ in rows if rest]
        if strings:
            decoded = _loads_bytes(b'["' + b'","'.join(strings) + b'"]')
            if type(decoded) is not list or len(decoded) != len(strings):
                return False
        else:
            decoded = []
        texts: list[str] = []
        next_text = iter(decoded).__next__
        last_timings = -1  # the block's last timings are the ones that count: a plain chunk's, or another's
        for i, (_, rest, other) in enumerate(rows):
            if rest:
                text = next_text()
                if text:
                    texts.append(text)
                continue
            self._output.add(texts, [])
            texts = []
            if other == b"[DONE]":
                self._complete = True
                continue
            obj = _loads_bytes(other)
            if type(obj) is dict:
                self._absorb(obj, False)
                if _raw_timings(obj) is not None:
                    last_timings = i
        self._output.add(texts, [])
        for i in range(len(rows) - 1, last_timings, -1) if any(b'"timings"' in rest for rest in rests) else ():
            content, rest, _ = rows[i]
            if rest and b'"timings"' in rest:
                found = _raw_timings(_loads_bytes(_PLAIN_HEAD + content + b'"}}],' + rest))
                if found is not None:  # else the bytes named timings without holding them: look further back
                    self._raw, self._timings = found, None
                    break
        return True

    def _read_values(self, body: bytes, count: int) -> None:
        """The block's events as one JSON array of their payloads (one decode), each read in its place."""
        values = _loads_bytes(b"[" + body[6:].replace(b"\n\ndata: ", b",") + b"]") if body else []
        if type(values) is not list or len(values) != count:  # not one JSON value a `data: ` line
            self._read_events(SSEParser().feed(body + b"\n\n"))
            return
        texts: list[str] = []
        for obj in values:
            if type(obj) is not dict:
                continue
            text = chat_delta_text(obj)
            if text is not None and "usage" not in obj and "error" not in obj:
                if text:
                    texts.append(text)
            else:  # any other event, in its place: read by the general readers
                self._output.add(texts, [])
                texts = []
                self._absorb(obj, False)
        self._output.add(texts, [])
        for obj in reversed(values):  # the block's last timings are the ones that count
            last = _raw_timings(obj)
            if last is not None:
                self._raw, self._timings = last, None
                break

    def _read_events(self, events: list[SSEEvent]) -> None:
        for event in events:
            if event.data == "[DONE]" or event.event in _END_EVENTS:
                self._complete = True
            obj = _loads(event.data) if event.data and event.data != "[DONE]" else None
            if isinstance(obj, dict):
                self._absorb(obj, event.event == "error")

    def on_body(self, body: bytes) -> None:
        """A whole non-streamed response body."""
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            return
        self._take(obj)
        self._output.add(*body_output(obj))
        if isinstance(obj, dict) and "error" in obj:
            self._error = _error_text(obj)

    def _take(self, obj: Any) -> None:
        found = _raw_timings(obj)
        if found is not None:
            self._raw, self._timings = found, None
        usage = find_usage(obj)
        if usage:
            # Anthropic streams split usage between message_start and message_delta: merge them.
            self._usage.update(usage)

    @property
    def timings(self) -> Timings | None:
        """llama-server's own timings; else counts from `usage` (flagged `from_usage`); else None."""
        self._digest()
        if self._timings is None and self._raw is not None:
            self._timings = parse_timings(self._raw)
        if self._timings is not None:
            return self._timings
        return timings_from_usage(self._usage) if self._usage else None


# Kept stream bytes are read once they pass this size, so a long answer never holds more of them.
_KEEP_LIMIT = 1024 * 1024


def _data_lines(block: bytes) -> tuple[bytes, bool, int] | None:
    """A block of events that are one `data: ` line each (llama-server's): the block without its `[DONE]`, whether
    it ended in one, and how many events are left; None for any other shape."""
    if block.endswith(b"data: [DONE]"):
        block, done = block[: -len(b"data: [DONE]")].rstrip(b"\n"), True
    else:
        done = False
    if not block:
        return b"", done, 0
    # Every line break is part of an event separator followed by `data: `: each event is one data line.
    separators = block.count(b"\n\ndata: ")
    if block[:6] != b"data: " or b"\r" in block or block.count(b"\n") != 2 * separators:
        return None
    return block, done, separators + 1


# llama-server's chat chunk of plain text, up to its content string (its other fields follow the choices).
_PLAIN_HEAD = b'{"choices":[{"finish_reason":null,"index":0,"delta":{"content":"'
# Each event of a block of one-line events, in order: (content string as JSON, rest, b"") for a plain text chunk
# (the content string's escapes are whole: it ends at the first unescaped quote); (b"", b"", payload) for any other.
_PLAIN_OR_OTHER = re.compile(
    rb"data: (?:" + re.escape(_PLAIN_HEAD) + rb'([^"\\\n]*+(?:\\.[^"\\\n]*+)*+)"\}\}\],([^\n]*\})|([^\n]*+))(?:\n\n|\Z)'
)
# Keys a plain chunk may not carry after its choices: each is read by the general readers (in a string value these
# bytes cannot occur unescaped, so finding them errs only towards the general readers).
_NOT_PLAIN_KEYS = re.compile(rb'"(?:usage|error|response|message|choices)"')


def _loads_bytes(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


def _error_text(obj: dict[str, Any]) -> str:
    err = obj.get("error", obj)
    if isinstance(err, dict):
        message = err.get("message")
        if isinstance(message, str):
            return message
    return str(err)[:500]


def _loads(data: str) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


def is_final_chunk(obj: dict[str, Any]) -> bool:
    kind = obj.get("type")
    if isinstance(kind, str):  # a Responses-API event: its last one carries the timings
        return kind in _END_EVENTS
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices:
        return True  # the usage chunk of `stream_options.include_usage`
    return any(isinstance(c, dict) and c.get("finish_reason") for c in choices)


def without_progress_timings(events: list[SSEEvent], parsed: list[dict[str, Any] | None] | None = None) -> bytes:
    """Re-encode stream events for a client that did not ask for per-token timings: `timings` stays only on the
    final chunk, where llama-server puts it anyway. `parsed`, when given, holds each event's already parsed object."""
    out = bytearray()
    for i, event in enumerate(events):
        data = event.data
        if '"timings"' in data and data.startswith("{"):
            obj = parsed[i] if parsed is not None else _loads(data)
            if isinstance(obj, dict) and "timings" in obj and not is_final_chunk(obj):
                del obj["timings"]
                data = orjson.dumps(obj).decode()
        if event.event:
            out += b"event: " + event.event.encode() + b"\n"
        for line in data.split("\n"):
            out += b"data: " + line.encode() + b"\n"
        out += b"\n"
    return bytes(out)
