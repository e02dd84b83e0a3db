"""The recorded llama-server answers (tests/data/llama-server/) against what the pinned patched server answers now:
the recorder's servers and requests (tests/support/processes/record_llama_server.py), each answer's shape (its keys
at any depth and their JSON types; values may differ) equal to its recording. The stock recordings are compared with
the patched server's answers less the keys the patches add (`PATCH_KEYS`). A recording the pinned build no longer
answers in fails here, naming the key: record again (tests/data/llama-server/README.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support.processes.record_llama_server import PATCHED, STOCK, patched_answers, stock_answers
from tests.support.recorded import recorded, shape_differences, without_patch_keys


@pytest.fixture(scope="module")
def answers(llama_server_binary: str, tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    home = tmp_path_factory.mktemp("recorded-answers")
    found = patched_answers(llama_server_binary, tiny_gguf, home)
    stock = stock_answers(llama_server_binary, tiny_gguf, home)
    return found | {name: without_patch_keys(answer) for name, answer in stock.items()}


@pytest.mark.parametrize("name", [*PATCHED, *STOCK])
def test_the_pinned_server_answers_in_the_recorded_shape(name: str, answers: dict[str, Any]) -> None:
    assert shape_differences(recorded(name), answers[name]) == []
