"""Gemini CLI's request shapes (tests/data/agent-shapes/gemini-cli/) against the chat bodies their translation must
give (tests/data/agent-shapes/gemini-cli/expected/): the Gemini API has no llama-server counterpart to compare with,
so its differential is this. A deliberate change of the translation is recorded again with
`ADAPTIVE_SPEC_RECORD_TRANSLATIONS=1 pytest tests/unit/requests/gemini/test_cli_translations.py` and shows in
review as a diff of those files."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from adaptive_spec.requests.gemini.request import Translated, gemini_target, to_chat

SHAPES = Path(__file__).resolve().parents[4] / "tests" / "data" / "agent-shapes" / "gemini-cli"
EXPECTED = SHAPES / "expected"


def _translated(shape: dict[str, Any]) -> dict[str, Any]:
    target = gemini_target(f"/v1beta/models/{shape['model']}:{shape['method'].split('?')[0]}")
    assert target is not None, shape["method"]
    translated = to_chat(json.dumps(shape["body"]).encode(), target)
    assert isinstance(translated, Translated), translated
    call = translated.call
    return {
        "chat": translated.chat,
        "model": call.model,
        "stream": call.stream,
        "sse": call.sse,
        "not_honoured": list(call.not_honoured),
    }


@pytest.mark.parametrize("path", sorted(SHAPES.glob("*.json")), ids=lambda p: p.stem)
def test_each_gemini_cli_shape_translates_to_its_expected_chat_body(path: Path) -> None:
    got = _translated(json.loads(path.read_text()))
    expected = EXPECTED / path.name
    if os.environ.get("ADAPTIVE_SPEC_RECORD_TRANSLATIONS"):
        EXPECTED.mkdir(exist_ok=True)
        expected.write_text(json.dumps(got, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    assert got == json.loads(expected.read_text()), f"{path.name}: the translation changed (see the docstring)"


def test_the_corpus_is_there() -> None:
    assert len(sorted(SHAPES.glob("*.json"))) >= 5
