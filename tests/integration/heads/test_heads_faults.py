"""The head store under faults on a REAL llama-server (tiny model, one slot): a full disk while the store writes, a
truncated, damaged or foreign head file, a save and a restore of one head at once, a restore into a slot another
request took meanwhile. Each ends in a served request, a logged reason (no traceback), and a store that repairs
itself within its bound."""

from __future__ import annotations

import asyncio
import errno
import logging
import zlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from adaptive_spec.kv.heads.files import checksum
from adaptive_spec.kv.heads.store import HeadStore
from adaptive_spec.kv.heads.values import Restored
from adaptive_spec.kv.moves import AfterTurn
from adaptive_spec.llama.upstreams import Upstream
from tests.support.heads import chat, erase, restore, start_proxy, store_of
from tests.support.processes.servers import LlamaServer

pytestmark = pytest.mark.asyncio(loop_scope="function")


@pytest.fixture(scope="module")
def server(
    llama_server_binary: str, tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LlamaServer, Path]]:
    home = tmp_path_factory.mktemp("heads-faults")
    (home / "slots").mkdir()
    args = (
        "-c",
        "8192",
        "--parallel",
        "1",
        "--cache-ram",
        "0",
        "--spec-type",
        "none",
        "--slot-save-path",
        str(home / "slots"),
    )
    llama = LlamaServer(llama_server_binary, tiny_gguf, *args, log_dir=home)
    yield llama, home
    llama.stop()


@pytest_asyncio.fixture(loop_scope="function")
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def _files(directory: Path, pattern: str = "*") -> list[str]:
    return sorted(p.name for p in directory.glob(pattern))


def _no_traceback(caplog: pytest.LogCaptureFixture) -> list[str]:
    """The store's warnings, each a reason in one line; none carries a traceback."""
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records if r.exc_info]
    return [r.getMessage() for r in caplog.records if r.name.startswith("adaptive_spec.kv.heads")]


def _full(*_: Any) -> Any:
    raise OSError(errno.ENOSPC, "No space left on device")


def _bound_holds(store: HeadStore) -> None:
    described = store.describe()
    assert described["bytes"] <= described["max_bytes"]
    assert len(_files(store.book.dir, "*.head")) == len(described["heads"])


@pytest.mark.parametrize("write", ["adaptive_spec.kv.heads.slot_io.take", "adaptive_spec.kv.heads.book.write_index"])
async def test_a_full_disk_while_the_store_writes_costs_the_head_not_the_request(
    server: tuple[LlamaServer, Path],
    client: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    write: str,
) -> None:
    llama, home = server
    caplog.set_level(logging.INFO, logger="adaptive_spec")
    proxy = await start_proxy(llama.url, home / "slots", tmp_path / "heads")
    try:
        monkeypatch.setattr(write, _full)  # the head's move into the store, or the index after it
        served = await chat(client, proxy, "full-1", "Write hello.py.")
        await store_of(proxy).settled()
        assert served["text"] is not None and store_of(proxy).counts["failed"] == 1
        assert any("No space left on device" in m for m in _no_traceback(caplog))
        assert _files(tmp_path / "heads", "*.head") == [] and _files(home / "slots") == []
        _bound_holds(store_of(proxy))
        monkeypatch.undo()  # the disk has room again: the next first turn of that head is kept
        await chat(client, proxy, "full-2", "Write hello.py.")
        await store_of(proxy).settled()
        assert store_of(proxy).counts["saved"] == 1 and len(_files(tmp_path / "heads", "*.head")) == 1
        _bound_holds(store_of(proxy))
    finally:
        await proxy.close()


@pytest.mark.parametrize("damage", ["truncated", "flipped", "foreign"])
async def test_a_damaged_head_is_removed_and_the_request_prefills(
    server: tuple[LlamaServer, Path],
    client: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
    damage: str,
) -> None:
    """Truncated (its size tells: dropped as the index is read), a flipped byte (its checksum tells, checked once a
    run in the background: removed), or a foreign file of the right size and checksum (another build's format:
    llama-server refuses it; kept, not restored there again, and replaced by the next save of that head)."""
    llama, home = server
    heads = tmp_path / "heads"
    proxy = await start_proxy(llama.url, home / "slots", heads)
    try:
        cold = await chat(client, proxy, "damage-1", "Write hello.py.")
        await store_of(proxy).settled()
        (head,) = _files(heads, "*.head")
    finally:
        await proxy.close()
    data = (heads / head).read_bytes()
    if damage == "truncated":
        (heads / head).write_bytes(data[: len(data) // 2])
    elif damage == "flipped":
        (heads / head).write_bytes(data[:-100] + bytes([data[-100] ^ 0xFF]) + data[-99:])
    else:
        (heads / head).write_bytes(b"not a slot file from this build".ljust(len(data), b"\0"))
        index = (heads / "index.json").read_text().replace(checksum_of(data), checksum(heads / head))
        (heads / "index.json").write_text(index)
    caplog.set_level(logging.INFO, logger="adaptive_spec")
    proxy = await start_proxy(llama.url, home / "slots", heads)
    try:
        await erase(client, proxy)
        again = await chat(client, proxy, "damage-2", "Write hello.py.")
        assert "warm:" not in again["record"]["reason"] and again["text"] == cold["text"], again
        await store_of(proxy).settled()  # and the store repairs itself: the same head is kept again, whole
        messages = _no_traceback(caplog)
        removed = any(f"{head.removesuffix('.head')} removed" in m for m in messages)
        assert removed == (damage == "flipped"), messages
        if damage == "foreign":
            assert any("restore on p" in m for m in messages) and store_of(proxy).counts["saved"] == 1, messages
        (kept,) = store_of(proxy).describe()["heads"]
        assert (heads / head).read_bytes() != data[: len(data) // 2] and kept["bytes"] == len(data)
        _bound_holds(store_of(proxy))
    finally:
        await proxy.close()


def checksum_of(data: bytes) -> str:
    return f"{zlib.crc32(data):08x}"


async def test_saves_and_a_restore_of_one_head_at_once(
    server: tuple[LlamaServer, Path],
    client: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """Two sessions of one agent start together with the same first turn: two saves of one head contend, the
    store's lock puts one after the other and one whole head is kept. A restore while a save holds the lock longer
    than the restore may wait (`_LOCK_WAIT_S` at most) returns without one; after it, the head restores."""
    llama, home = server
    heads = tmp_path / "heads"
    proxy = await start_proxy(llama.url, home / "slots", heads)
    store = store_of(proxy)
    seen: list[tuple[Any, ...]] = []
    after_turn = store.after_turn

    def keep(upstream: Upstream, after: AfterTurn) -> None:
        if after.save is not None:
            seen.append((upstream, None, list(after.save.turn.pieces)))
        after_turn(upstream, after)

    monkeypatch.setattr(store, "after_turn", keep)
    try:
        one, two = await asyncio.gather(
            chat(client, proxy, "together-1", "Write hello.py."), chat(client, proxy, "together-2", "Write hello.py.")
        )
        upstream, _, pieces = seen[0][:3]
        await store.settled()
        assert one["text"] == two["text"]
        described = store.describe()
        assert described["counts"]["failed"] == 0 and len(described["heads"]) == 1, described
        (entry,) = described["heads"]
        assert (heads / f"{entry['id']}.head").stat().st_size == entry["bytes"]

        entered, gate, save_slot = asyncio.Event(), asyncio.Event(), store._io.save_slot

        async def held_open(*args: Any) -> tuple[int, object, float]:  # another head's save, holding the lock
            entered.set()
            await gate.wait()
            return await save_slot(*args)

        monkeypatch.setattr(store._io, "save_slot", held_open)
        await erase(client, proxy)
        await chat(client, proxy, "other-1", "Write hello.py.", system="You review code. " * 80)
        await entered.wait()
        assert await restore(store, upstream, None, pieces) is None  # during the save: nothing
        assert store.counts["restored"] == 0 and store.counts["failed"] == 0
        gate.set()
        await store.settled()
        assert len(store.describe()["heads"]) == 2
        await erase(client, proxy)
        restored = await restore(store, upstream, None, pieces)  # after it: the head
        assert restored is not None and restored.head == entry["id"], restored
        _no_traceback(caplog)
        _bound_holds(store)
        await erase(client, proxy)
        warm = await chat(client, proxy, "together-3", "Write hello.py.")
        assert "warm: head of" in warm["record"]["reason"] and warm["text"] == one["text"], warm
    finally:
        await proxy.close()


async def test_a_restore_into_a_slot_another_request_took_is_not_learned_as_inert(
    server: tuple[LlamaServer, Path],
    client: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    llama, home = server
    caplog.set_level(logging.INFO, logger="adaptive_spec")
    proxy = await start_proxy(llama.url, home / "slots", tmp_path / "heads")
    store = store_of(proxy)
    try:
        cold = await chat(client, proxy, "took-1", "Write hello.py.")
        await store.settled()
        restore = store.restore

        async def then_another_request(*args: Any) -> Restored | None:
            restored = await restore(*args)
            if restored is not None:  # another session's request takes the slot before this one is forwarded
                await chat(client, proxy, "intruder", "Hi.", system="Be brief.", max_tokens=2)
            return restored

        monkeypatch.setattr(store, "restore", then_another_request)
        await erase(client, proxy)
        taken = await chat(client, proxy, "took-2", "Write hello.py.")
        assert taken["text"] == cold["text"] and taken["timings"]["cache_n"] < 100, taken  # re-prefilled, right
        assert store.counts["taken"] == 1 and store.describe()["inert_servers"] == []
        assert any("another request took" in m for m in _no_traceback(caplog))
        monkeypatch.undo()
        await erase(client, proxy)
        warm = await chat(client, proxy, "took-3", "Write hello.py.")  # restores still tried there, and work
        assert "warm: head of" in warm["record"]["reason"] and warm["timings"]["cache_n"] > 256, warm
    finally:
        await proxy.close()
