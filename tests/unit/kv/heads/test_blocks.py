"""A head matched below its pieces: a new project of a known agent (its working directory inside the system prompt)
shares the blocks before it with a stored head, under the same key and tenant only; and only on a target that resumes a
restored slot at any token (a dense one, or a sliding window kept whole)."""

from __future__ import annotations

from pathlib import Path

import gguf

from adaptive_spec.kv.heads.matching import (
    BLOCK_CHARS,
    HeadEntry,
    ServerKey,
    best_match,
    block_chains,
    chain,
    text_blocks,
)
from adaptive_spec.kv.heads.slot_io import _any_prefix
from tests.support.models.tiny_drafters import write_tiny_mtp_target
from tests.support.models.tiny_gguf import write_tiny_gguf

KEY = ServerKey("/models/qwen.gguf", 491_400_064, 8192, "t1")
RULES = "".join(f"Rule {i}: keep function_{i} small and typed.\n" for i in range(120))  # ~5,000 characters


def _system(directory: str) -> str:
    return RULES + f"Working directory: {directory}\n" + "Tool notes follow.\n" * 40


def _prompt(directory: str) -> list[tuple[str, str]]:
    return [("system", _system(directory)), ("tools", '[{"name":"read"}]'), ("user", "Write hello.py.")]


def _head(texts: list[tuple[str, str]], scope: str = "", tokens: int = 2000) -> HeadEntry:
    links = chain(KEY, [f"{kind}:{text}".encode() for kind, text in texts], scope)
    blocks = block_chains(KEY, links, [text_blocks(kind, text) for kind, text in texts], scope)
    chars = tuple(len(text) for _, text in texts)
    return HeadEntry(links[-1][:24], links, chars, tokens, tokens + 4, 100, 0.0, 0.0, scope=scope, blocks=blocks)


def _new(
    texts: list[tuple[str, str]], scope: str = "", key: ServerKey = KEY
) -> tuple[tuple[str, ...], tuple[tuple[str, ...], ...]]:
    links = chain(key, [f"{kind}:{text}".encode() for kind, text in texts], scope)
    return links, block_chains(key, links, [text_blocks(kind, text) for kind, text in texts], scope)


def test_a_new_project_shares_the_blocks_before_its_working_directory() -> None:
    head = _head(_prompt("/home/a/project-alpha"))
    links, blocks = _new(_prompt("/home/a/project-beta"))
    match = best_match(links, [head], blocks)
    assert match is not None and match.pieces == 0
    shared_blocks = len(RULES) // BLOCK_CHARS  # the blocks wholly before the working directory
    assert match.blocks == shared_blocks, (match.blocks, shared_blocks)
    total = sum(head.chars)
    assert match.tokens == head.prompt_tokens * shared_blocks * BLOCK_CHARS // total
    assert best_match(links, [head]) is None  # matched by whole pieces alone, the new project shares nothing


def test_the_blocks_of_a_later_piece_count_after_the_pieces_before_it() -> None:
    texts = _prompt("/home/a/project-alpha")
    long_user = ("user", "Explain this file:\n" + "x = 1\n" * 200)
    head = _head([*texts[:2], long_user])
    links, blocks = _new([*texts[:2], (long_user[0], long_user[1][:700] + "changed" + long_user[1][707:])])
    match = best_match(links, [head], blocks)
    assert match is not None and (match.pieces, match.blocks) == (2, 2)
    shared_chars = len(texts[0][1]) + len(texts[1][1]) + 2 * BLOCK_CHARS
    assert match.tokens == head.prompt_tokens * shared_chars // sum(head.chars)


def test_another_tenants_or_another_keys_head_is_never_matched_by_its_blocks() -> None:
    alpha, beta = _prompt("/home/a/project-alpha"), _prompt("/home/a/project-beta")
    team_a = _head(alpha, scope="team-a")
    links, blocks = _new(beta, scope="team-b")
    assert best_match(links, [team_a], blocks) is None
    links, blocks = _new(beta)  # no scope: not team-a's either
    assert best_match(links, [team_a], blocks) is None
    links, blocks = _new(beta, scope="team-a")
    assert best_match(links, [team_a], blocks) is not None
    other_model = ServerKey("/models/other.gguf", 491_400_064, 8192, "t1")
    links, blocks = _new(beta, key=other_model)
    assert best_match(links, [_head(alpha)], blocks) is None


def test_the_same_text_under_another_role_shares_no_block() -> None:
    head = _head([("user", _system("/home/a/project-alpha"))])
    links, blocks = _new([("system", _system("/home/a/project-alpha"))])
    assert best_match(links, [head], blocks) is None


def test_blocks_survive_the_index_and_a_head_without_them_matches_by_pieces() -> None:
    head = _head(_prompt("/home/a/project-alpha"))
    assert HeadEntry.from_json(head.to_json()) == head
    old = HeadEntry.from_json({k: v for k, v in head.to_json().items() if k != "blocks"})
    assert old is not None and old.blocks == ()
    links, blocks = _new(_prompt("/home/a/project-beta"))
    assert best_match(links, [old], blocks) is None
    damaged = {**head.to_json(), "blocks": head.to_json()["blocks"][:1]}  # not one chain per piece
    assert HeadEntry.from_json(damaged) is None


def _sliding_window_header(path: Path) -> Path:
    """A GGUF header of Gemma 3's shape (no tensors: only the header is read): a sliding window of 512."""
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(18)
    writer.add_head_count(4)
    writer.add_head_count_kv(1)
    writer.add_embedding_length(640)
    writer.add_uint32("gemma3.attention.sliding_window", 512)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_only_a_target_that_resumes_anywhere_takes_a_match_inside_a_piece(tmp_path: Path) -> None:
    dense = write_tiny_gguf(tmp_path / "dense.gguf")
    hybrid = write_tiny_mtp_target(tmp_path / "hybrid.gguf")
    swa = _sliding_window_header(tmp_path / "swa.gguf")
    assert _any_prefix(str(dense))
    assert not _any_prefix(str(hybrid))  # a recurrent state resumes only at a checkpoint
    assert not _any_prefix(str(swa))  # so does a sliding window's cache (its slot file keeps the window alone)
    assert not _any_prefix(str(tmp_path / "missing.gguf"))
