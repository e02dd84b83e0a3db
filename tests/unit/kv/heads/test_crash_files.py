"""The store's files after a crash: a lost or unreadable index is rebuilt from each head's own entry, an entry the
index never named joins it, leftovers and planted symlinks are swept, no symlink is followed, and a second `serve` on
the same folder is told it is in use."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import pytest

from adaptive_spec.kv.heads.book import HeadBook
from adaptive_spec.kv.heads.files import ENTRY, INDEX, load_index, sweep_slot_files, take, write_entry, write_index
from adaptive_spec.kv.heads.matching import HeadEntry, ServerKey, chain

KEY = ServerKey("/models/qwen.gguf", 491_400_064, 8192, "t1")


def _entry(n: int, size: int) -> HeadEntry:
    links = chain(KEY, [bytes([n])])
    return HeadEntry(links[-1][:24], links, (100,), 1000, 1004, size, 1.0, 1.0, key=KEY.hex())


def _head(directory: Path, entry: HeadEntry) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{entry.id}.head").write_bytes(b"k" * entry.bytes)
    write_entry(directory, entry)


@pytest.mark.parametrize("index", ["lost", "unreadable", "half-written"])
def test_a_lost_or_damaged_index_is_rebuilt_from_the_heads_own_entries(tmp_path: Path, index: str) -> None:
    a, b = _entry(1, 10), _entry(2, 20)
    _head(tmp_path, a)
    _head(tmp_path, b)
    write_index(tmp_path, [a, b])
    if index == "lost":
        (tmp_path / INDEX).unlink()
    elif index == "unreadable":
        (tmp_path / INDEX).write_text('[{"id": "')
    else:
        (tmp_path / f".{INDEX}.tmp").write_text("[")
        (tmp_path / INDEX).unlink()
    assert load_index(tmp_path) == {a.id: a, b.id: b}  # every sound head kept
    assert not (tmp_path / f".{INDEX}.tmp").exists()


def test_a_head_saved_after_the_last_index_joins_it_and_what_nothing_names_is_swept(tmp_path: Path) -> None:
    a, b = _entry(1, 10), _entry(2, 20)
    _head(tmp_path, a)
    write_index(tmp_path, [a])
    _head(tmp_path, b)  # killed after its entry, before the index named it
    (tmp_path / "orphan.head").write_bytes(b"x")  # a head whose entry never came
    (tmp_path / ".c.head.tmp").write_bytes(b"x")  # a copy cut short
    (tmp_path / f".{b.id}{ENTRY}.tmp").write_text("{")
    truncated = _entry(3, 30)
    _head(tmp_path, truncated)
    (tmp_path / f"{truncated.id}.head").write_bytes(b"k" * 7)
    assert load_index(tmp_path) == {a.id: a, b.id: b}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [INDEX, f"{a.id}.head", f"{a.id}{ENTRY}", f"{b.id}.head", f"{b.id}{ENTRY}"]
    )


def test_no_symlink_is_followed_or_kept(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_bytes(b"v" * 10)
    os.chmod(victim, 0o644)
    slots, heads = tmp_path / "slots", tmp_path / "heads"
    slots.mkdir()
    heads.mkdir()
    (slots / "head-x.bin").symlink_to(victim)  # planted where llama-server writes
    with pytest.raises(OSError):
        take(slots / "head-x.bin", heads / "x.head")
    assert oct(victim.stat().st_mode & 0o777) == oct(0o644) and not (heads / "x.head").exists()
    a = _entry(1, 10)
    (heads / f"{a.id}.head").symlink_to(victim)
    write_entry(heads, a)
    write_index(heads, [a])
    assert load_index(heads) == {}  # a head that is a link is not one
    assert victim.exists() and not (heads / f"{a.id}.head").exists()


def test_a_second_store_on_the_same_folder_is_told_it_is_in_use(tmp_path: Path) -> None:
    async def main() -> None:
        first = HeadBook(tmp_path / "heads", 10**9)
        with pytest.raises(OSError, match=rf"in use by another adaptive-spec serve \(pid {os.getpid()}\)"):
            HeadBook(tmp_path / "heads", 10**9)
        first.close()
        HeadBook(tmp_path / "heads", 10**9).close()  # free again once the first let go

    asyncio.run(main())


def test_slot_files_a_cut_save_left_are_swept_but_not_one_under_way(tmp_path: Path) -> None:
    old, new, other = tmp_path / "head-a.bin", tmp_path / "head-b.bin", tmp_path / "s123.bin"
    for path in (old, new, other):
        path.write_bytes(b"x")
    past = time.time() - 3600
    os.utime(old, (past, past))
    os.utime(other, (past, past))
    assert sweep_slot_files(tmp_path, "head-") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head-b.bin", "s123.bin"]


def test_an_entry_file_holds_the_index_entry(tmp_path: Path) -> None:
    a = _entry(4, 40)
    write_entry(tmp_path, a)
    assert HeadEntry.from_json(json.loads((tmp_path / f"{a.id}{ENTRY}").read_text())) == a
