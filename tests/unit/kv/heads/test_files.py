"""The head store's files under faults: a store left by a killed run, a truncated or damaged head, a full disk while
the index or a head is written; each repaired on load or refused with the last good state kept, and the bound on
bytes held."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from adaptive_spec.kv.heads.book import HeadBook
from adaptive_spec.kv.heads.files import INDEX, adopt, checksum, load_index, stage, take, write_index
from adaptive_spec.kv.heads.matching import HeadEntry, ServerKey, chain

KEY = ServerKey("/models/qwen.gguf", 491_400_064, 8192, "t1")


def _entry(n: int, size: int, used: float = 0.0, crc: str = "") -> HeadEntry:
    links = chain(KEY, [bytes([n])])
    return HeadEntry(links[-1][:24], links, (100,), 1000, 1004, size, used, used, key=KEY.hex(), crc=crc)


def _store(directory: Path, *entries: tuple[HeadEntry, bytes]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for entry, data in entries:
        (directory / f"{entry.id}.head").write_bytes(data)
    write_index(directory, [e for e, _ in entries])


def _into(counts: dict[str, int]) -> Callable[[str, int], None]:
    """The book's counts kept in `counts` (the store's, in the proxy)."""

    def count(name: str, n: int) -> None:
        counts[name] = counts.get(name, 0) + n

    return count


def _heads(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.head"))


def test_a_store_left_by_a_killed_run_is_repaired_on_load(tmp_path: Path) -> None:
    whole, cut = _entry(1, 100), _entry(2, 100)
    _store(tmp_path, (whole, b"x" * 100), (cut, b"x" * 100))
    (tmp_path / f"{cut.id}.head").write_bytes(b"x" * 40)  # a copy cut short
    (tmp_path / "0123456789abcdef01234567.head").write_bytes(b"saved, never indexed")  # killed before its index
    (tmp_path / f".{INDEX}.tmp").write_text('[{"id": ')  # killed while writing the index
    assert load_index(tmp_path) == {whole.id: whole}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([f"{whole.id}.head", INDEX])


def test_an_unreadable_index_starts_an_empty_store_without_stray_files(tmp_path: Path) -> None:
    entry = _entry(1, 10)
    _store(tmp_path, (entry, b"x" * 10))
    (tmp_path / INDEX).write_text("{not json")
    assert load_index(tmp_path) == {}
    assert [p.name for p in tmp_path.iterdir()] == [INDEX]


def test_a_full_disk_while_the_index_is_written_keeps_the_last_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _entry(1, 10)
    _store(tmp_path, (first, b"x" * 10))

    def full(*_: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError, match="No space"):
        write_index(tmp_path, [first, _entry(2, 10)])
    assert [e["id"] for e in json.loads((tmp_path / INDEX).read_text())] == [first.id]
    assert not (tmp_path / f".{INDEX}.tmp").exists()


def test_a_head_taken_across_filesystems_is_copied_whole_or_not_at_all(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slots, heads = tmp_path / "slots", tmp_path / "heads"
    slots.mkdir()
    heads.mkdir()
    real_replace = os.replace

    def cross_device(src: Any, dst: Any) -> None:
        if Path(src).parent == slots:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", cross_device)
    (slots / "head-a.bin").write_bytes(b"k" * 64)
    assert take(slots / "head-a.bin", heads / "a.head") == (64, checksum(heads / "a.head"))  # taken in its thread
    assert stat.S_IMODE((heads / "a.head").stat().st_mode) == 0o600

    def no_space(src: Any, dst: Any) -> None:
        Path(dst).write_bytes(b"k" * 8)  # part of it written
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", no_space)
    (slots / "head-b.bin").write_bytes(b"k" * 64)
    with pytest.raises(OSError, match="No space"):
        take(slots / "head-b.bin", heads / "b.head")
    assert sorted(p.name for p in heads.iterdir()) == ["a.head"]  # no half head under any name


def test_a_damaged_head_fails_its_checksum(tmp_path: Path) -> None:
    head = tmp_path / "a.head"
    head.write_bytes(bytes(range(256)) * 1000)
    before = checksum(head)
    data = bytearray(head.read_bytes())
    data[100_000] ^= 0x01
    head.write_bytes(bytes(data))
    assert checksum(head) != before


@pytest.mark.asyncio(loop_scope="function")
async def test_the_book_keeps_its_bound_and_refuses_a_save_without_free_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counts = dict.fromkeys(("refused", "evicted", "removed"), 0)
    book = HeadBook(tmp_path, max_bytes=250, count=_into(counts))
    for n in range(4):
        (tmp_path / f"{_entry(n, 100).id}.head").write_bytes(b"x" * 100)
        await book.add(_entry(n, 100, used=float(n)))
        assert sum(e.bytes for e in book.heads()) <= 250
    assert [e.id for e in book.heads()] == [_entry(2, 100).id, _entry(3, 100).id]
    assert counts["evicted"] == 2 and len(_heads(tmp_path)) == 2
    assert [e["id"] for e in json.loads((tmp_path / INDEX).read_text())] == [e.id for e in book.heads()]

    class Usage:
        free = 10 * 1024**2

    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage())
    assert not await book.room(prompt_tokens=1000) and counts["refused"] == 1
    Usage.free = 10 * 1024**4
    assert await book.room(prompt_tokens=2)  # room on the disk, within the bound ...
    assert len(book.heads()) == 2 and counts["evicted"] == 2  # ... and nothing evicted for a save not made yet
    assert not await book.room(prompt_tokens=10**6) and counts["refused"] == 2  # a head larger than the bound: no


@pytest.mark.asyncio(loop_scope="function")
async def test_a_truncated_or_damaged_head_is_removed_before_any_restore(tmp_path: Path) -> None:
    data = bytes(range(256)) * 40
    (tmp_path / "probe").write_bytes(data)
    good, cut, flipped = (_entry(n, len(data), crc=checksum(tmp_path / "probe")) for n in range(3))
    _store(tmp_path, (good, data), (cut, data), (flipped, data))
    (tmp_path / f"{cut.id}.head").write_bytes(data[:100])
    (tmp_path / f"{flipped.id}.head").write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    counts = dict.fromkeys(("refused", "evicted", "removed"), 0)
    book = HeadBook(tmp_path, max_bytes=10**9, count=_into(counts))
    assert book.entry(cut.id) is None  # its size told at load
    assert not await book.check(good)  # not restored before its checksum is verified (in the background)
    await book.verify()
    assert await book.check(good) and not await book.check(flipped)
    assert [e.id for e in book.heads()] == [good.id] and counts["removed"] == 1
    assert _heads(tmp_path) == [f"{good.id}.head"]
    assert [e["id"] for e in json.loads((tmp_path / INDEX).read_text())] == [good.id]
    assert await book.delete([good.id]) == 1
    await book.used(good)  # its restore ended after it was deleted: it is not brought back
    assert book.heads() == [] and json.loads((tmp_path / INDEX).read_text()) == []


@pytest.mark.asyncio(loop_scope="function")
async def test_a_head_a_request_wants_is_verified_at_once_and_the_pass_starts_with_the_newest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Right after a restart the background pass may not have reached the head a resumed conversation matches best
    (its own state, the newest): the request has it checked there and then instead of settling for an older head."""
    data = bytes(range(256)) * 40
    (tmp_path / "probe").write_bytes(data)
    crc = checksum(tmp_path / "probe")
    old, new, mid = _entry(1, len(data), 10.0, crc), _entry(2, len(data), 30.0, crc), _entry(3, len(data), 20.0, crc)
    _store(tmp_path, (old, data), (new, data), (mid, data))
    flipped = tmp_path / f"{mid.id}.head"
    flipped.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    counts = dict.fromkeys(("refused", "evicted", "removed"), 0)
    book = HeadBook(tmp_path, max_bytes=10**9, count=_into(counts))
    assert await book.verify_one(new) and await book.check(new) and not book.verified(old.id)
    assert not await book.verify_one(mid) and book.entry(mid.id) is None and counts["removed"] == 1
    book.close()

    # A store of three whole heads: the background pass reads the most recently used first.
    _store(tmp_path, (old, data), (new, data), (mid, data))
    read: list[str] = []

    def recorded(path: Path) -> str:
        read.append(path.stem)
        return crc

    monkeypatch.setattr("adaptive_spec.kv.heads.book.checksum", recorded)
    book = HeadBook(tmp_path, max_bytes=10**9)
    await book.verify()
    assert read == [new.id, mid.id, old.id]
    assert await book.verify_one(old) and read == [new.id, mid.id, old.id]  # once a run
    book.close()


def test_a_staged_copy_is_private_from_its_first_byte_and_the_heads_directory_is_made_private(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    head, staged = tmp_path / "a.head", tmp_path / "slots" / "head-a.bin"
    staged.parent.mkdir()
    head.write_bytes(b"kv" * 1000)
    os.chmod(head, 0o644)
    modes: list[int] = []
    copy = shutil.copyfileobj

    def watched(src: Any, out: Any, length: int = 0) -> None:
        modes.append(stat.S_IMODE(os.fstat(out.fileno()).st_mode))  # as the copy begins
        copy(src, out, length)

    def other_filesystem(*_: Any) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", other_filesystem)
    monkeypatch.setattr(shutil, "copyfileobj", watched)
    old_umask = os.umask(0)
    try:
        stage(head, staged)
    finally:
        os.umask(old_umask)
    assert modes == [0o600] and stat.S_IMODE(staged.stat().st_mode) == 0o600
    assert staged.read_bytes() == head.read_bytes()

    shared = tmp_path / "heads"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    HeadBook(shared, max_bytes=10**9)
    assert stat.S_IMODE(shared.stat().st_mode) == 0o700


@pytest.mark.asyncio(loop_scope="function")
async def test_one_tenant_fills_only_its_own_share_of_the_bound(tmp_path: Path) -> None:
    counts = dict.fromkeys(("refused", "evicted", "removed"), 0)
    book = HeadBook(tmp_path, max_bytes=400, count=_into(counts), tenants=2)  # 200 bytes each
    theirs = replace(_entry(9, 100, used=0.0), scope="team-b")
    (tmp_path / f"{theirs.id}.head").write_bytes(b"x" * 100)
    await book.add(theirs)
    for n in range(4):  # team-a's heads, newer than team-b's, more than its share
        mine = replace(_entry(n, 100, used=float(n + 1)), scope="team-a")
        (tmp_path / f"{mine.id}.head").write_bytes(b"x" * 100)
        await book.add(mine)
    kept = {e.id: e.scope for e in book.heads()}
    assert list(kept.values()).count("team-a") == 2 and theirs.id in kept, kept  # team-b's oldest head stays
    large = replace(_entry(7, 300, used=9.0), scope="team-b")
    (tmp_path / f"{large.id}.head").write_bytes(b"x" * 300)
    await book.add(large)  # larger than a share: not kept, and nothing of team-b's pushed out for it
    assert book.entry(large.id) is None and book.entry(theirs.id) is not None and counts["refused"] == 1
    assert not (tmp_path / f"{large.id}.head").exists()
    book.close()


@pytest.mark.asyncio(loop_scope="function")
async def test_a_projects_policy_sets_its_share_and_the_others_keep_the_equal_one(tmp_path: Path) -> None:
    book = HeadBook(tmp_path, max_bytes=900, tenants=3)
    assert book.share("team-a") == book.share("team-b") == 300
    book.set_share("team-a", 600)
    assert (book.share("team-a"), book.share("team-b")) == (600, 300)
    book.set_share("team-a", 10**9)
    assert book.share("team-a") == 900  # never more than the whole bound
    book.set_share("team-a", 0)
    assert book.share("team-a") == 300  # back to an equal share
    book.close()


def test_another_proxys_head_is_read_only_from_a_file_of_its_own_name(tmp_path: Path) -> None:
    """The shared state names the other proxy's file; a name other than the head's is not read (a writer of the shared
    state could otherwise have any file this proxy can read copied into its store)."""
    (tmp_path / "mine").mkdir()
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"not a head")
    head = tmp_path / "mine" / "abc123.bin"
    why = adopt(secret, head, len(b"not a head"), checksum(secret))
    assert why is not None and "not named abc123.bin" in why, why
    assert not head.exists()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "abc123.bin").write_bytes(b"kv bytes")
    assert adopt(theirs / "abc123.bin", head, 8, checksum(theirs / "abc123.bin")) is None
    assert head.read_bytes() == b"kv bytes"
