"""Each piece's text as the head store's block digests read it (`piece_texts`) lines up with the pieces the router read
(`prompt_pieces`): the same count, order and characters, for every agent shape the proxy is tested with."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from adaptive_spec.routing.prompt.pieces import piece_texts, prompt_pieces

SHAPES = Path(__file__).resolve().parents[3] / "data" / "agent-shapes"


def _bodies() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(SHAPES.glob("*.json")):
        body = json.loads(path.read_text())
        if isinstance(body, dict) and (body.get("messages") or body.get("input") or body.get("prompt")):
            out.append((path.stem, body))
    return out


@pytest.mark.parametrize(("name", "body"), _bodies(), ids=[n for n, _ in _bodies()])
def test_the_texts_line_up_with_the_pieces(name: str, body: dict[str, Any]) -> None:
    pieces, texts = prompt_pieces(body), piece_texts(body)
    assert [len(text) for _, text in texts] == [p.chars for p in pieces], name
    assert [kind == "tools" for kind, _ in texts] == [p.tools for p in pieces], name


def test_every_shape_is_read() -> None:
    assert len(_bodies()) >= 6, [n for n, _ in _bodies()]


def test_a_plain_prompt_is_one_text() -> None:
    assert piece_texts({"prompt": "def f():"}) == [("prompt", "def f():")]
