"""Gemini answers read in tests: the chunks of an SSE stream (through the project's own SSE parser, each event ended
as Google ends them) and the text a list of chunks carries."""

from __future__ import annotations

import json
from typing import Any

from tests.support.sse import events


def sse_chunks(data: bytes, keepalives: bool = False) -> list[dict[str, Any]]:
    """The chunks of a Gemini SSE stream; each event ends in CRLF CRLF unless `keepalives` (SSE comments) came too."""
    found = events(data)
    assert all(e.event == "" for e in found)
    if not keepalives:
        assert data.count(b"\r\n\r\n") == len(found) and data.endswith(b"\r\n\r\n")
    return [json.loads(e.data) for e in found]


def text_of(chunks: list[dict[str, Any]]) -> str:
    """The text parts of every chunk's first candidate, joined (thoughts included)."""
    return "".join(p.get("text", "") for c in chunks for p in c["candidates"][0]["content"].get("parts", []))
