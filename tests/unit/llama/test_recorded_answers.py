"""The recorded llama-server answers and the shape check that compares the pinned server's answers with them
(tests/support/recorded.py; the comparison itself is tests/integration/server/test_recorded_answers.py): the stock
recordings hold no key the patches add, the patched ones hold each, and a key renamed or a type changed anywhere in a
copy of a recording is a difference, a value changed is not."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.processes.record_llama_server import PATCHED, STOCK
from tests.support.recorded import PATCH_KEYS, recorded, shape_differences, without_patch_keys


def _keys(answer: Any) -> Iterator[str]:
    if isinstance(answer, dict):
        for k, v in answer.items():
            yield k
            yield from _keys(v)
    elif isinstance(answer, list):
        for v in answer:
            yield from _keys(v)


def _paths(answer: Any, path: tuple[str | int, ...] = ()) -> Iterator[tuple[str | int, ...]]:
    """Every key's path in `answer` (an array's first item only)."""
    if isinstance(answer, dict):
        for k, v in answer.items():
            yield (*path, k)
            yield from _paths(v, (*path, k))
    elif isinstance(answer, list) and answer:
        yield from _paths(answer[0], (*path, 0))


def _parent(answer: Any, path: tuple[str | int, ...]) -> Any:
    for step in path[:-1]:
        answer = answer[step]
    return answer


@pytest.mark.parametrize("name", STOCK)
def test_a_stock_recording_holds_no_key_the_patches_add(name: str) -> None:
    assert not set(_keys(recorded(name))) & PATCH_KEYS.keys()
    assert without_patch_keys(recorded(name)) == recorded(name)


def test_every_key_the_patches_add_is_in_a_patched_recording() -> None:
    found = {k for name in PATCHED for k in _keys(recorded(name))}
    assert PATCH_KEYS.keys() <= found, PATCH_KEYS.keys() - found


@pytest.mark.parametrize("name", [*PATCHED, *STOCK])
def test_a_renamed_key_or_a_changed_type_anywhere_is_a_difference(name: str) -> None:
    original = recorded(name)
    assert shape_differences(original, recorded(name)) == []
    paths = list(_paths(original))
    assert paths
    for path in paths:
        renamed = copy.deepcopy(original)
        parent = _parent(renamed, path)
        parent[f"{path[-1]}_renamed"] = parent.pop(path[-1])
        assert shape_differences(original, renamed), path
        retyped = copy.deepcopy(original)
        parent = _parent(retyped, path)
        parent[path[-1]] = [] if isinstance(parent[path[-1]], str | int | float | dict) else "x"
        assert shape_differences(original, retyped), path


def test_values_may_differ_and_the_difference_is_named() -> None:
    answer = recorded("chat_completion_ngram")
    changed = copy.deepcopy(answer)
    changed["timings"]["prompt_n"] += 7
    changed["choices"][0]["message"]["content"] = "other text"
    assert shape_differences(answer, changed) == []
    del changed["timings"]["cache_n"]
    changed["usage"]["completion_tokens"] = "12"
    assert shape_differences(answer, changed) == [
        "$.timings.cache_n: not answered",
        "$.usage.completion_tokens: a string, recorded a number",
    ]
