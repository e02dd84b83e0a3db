from __future__ import annotations

import asyncio
from collections.abc import Sequence

from adaptive_spec.sessions.tokenizers import CachingTokenizer, _chunks, tiktoken_o200k


def test_tiktoken_o200k_loads_offline_and_encodes_like_tiktoken() -> None:
    tokenizer = tiktoken_o200k()
    assert tokenizer.name == "tiktoken:o200k_base"
    assert asyncio.run(tokenizer.encode(["hello world", ""])) == [[24912, 2375], []]


class _Counting:
    name = "counting"

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    async def encode(self, texts: Sequence[str]) -> list[list[int]]:
        self.calls.append(list(texts))
        return [[len(t)] for t in texts]


def test_cache_tokenizes_each_text_once_and_stays_bounded() -> None:
    inner = _Counting()
    cache = CachingTokenizer(inner, max_tokens=2)
    assert asyncio.run(cache.encode(["a", "bb", "a"])) == [[1], [2], [1]]
    assert asyncio.run(cache.encode(["bb", "ccc"])) == [[2], [3]]
    assert inner.calls == [["a", "bb"], ["ccc"]]
    assert asyncio.run(cache.encode(["a"])) == [[1]]
    assert inner.calls[-1] == ["a"]  # "a" was the least recently used and had been dropped


def test_long_text_is_cut_at_line_ends() -> None:
    text = ("line of code\n" * 3000) + "tail"
    pieces = _chunks(text)
    assert "".join(pieces) == text
    assert all(len(p) <= 16_000 for p in pieces) and all(p.endswith("\n") for p in pieces[:-1])
