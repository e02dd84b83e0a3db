"""The head stores of two proxies kept in step: a head one saved is taken by the other from its folder (its size and
checksum checked), not from a proxy whose tenants differ, nor with a damaged file; heads removed there are removed
here; a verdict told is heard."""

from __future__ import annotations

import time
from pathlib import Path

import aiohttp
import pytest

from adaptive_spec.kv.heads.files import checksum
from adaptive_spec.kv.heads.matching import HeadEntry, ServerKey, chain
from adaptive_spec.kv.heads.store import HeadStore
from adaptive_spec.kv.heads.values import HeadsConfig
from adaptive_spec.shared_state.heads import SharedHeads, tenants_digest
from adaptive_spec.shared_state.news import HeadInert, HeadSaved, HeadsGone
from adaptive_spec.shared_state.shell import SharedState
from adaptive_spec.shared_state.store import MemoryStore

KEY = ServerKey("/models/qwen.gguf", 491_400_064, 8192, "t1")


def _store(home: Path, name: str, keys: dict[str, str] | None = None) -> tuple[HeadStore, SharedHeads]:
    shared = SharedHeads(SharedState(MemoryStore(), proxy_id=name), keys or {})
    config = HeadsConfig(home / name / "heads", project_keys=keys or {})
    (home / name / "slots").mkdir(parents=True)
    store = HeadStore(config, home / name / "slots", lambda: aiohttp.ClientSession(), told=shared)
    shared.store = store
    return store, shared


def _saved(home: Path, data: bytes = b"kv" * 500) -> tuple[HeadEntry, Path]:
    links = chain(KEY, [b"system", b"tools"])
    path = home / "elsewhere" / f"{links[-1][:24]}.head"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    now = time.time()
    entry = HeadEntry(links[-1][:24], links, (400, 500), 900, 904, len(data), now, now, crc=checksum(path))
    return entry, path


@pytest.mark.asyncio
async def test_a_head_saved_elsewhere_is_taken_checked_and_removed_when_told(tmp_path: Path) -> None:
    store, shared = _store(tmp_path, "b")
    entry, path = _saved(tmp_path)
    await shared.heard(HeadSaved("a", entry.id, entry.to_json(), str(path), tenants_digest({})))
    kept = store.book.entry(entry.id)
    assert kept is not None and store.book.path(entry.id).read_bytes() == path.read_bytes()
    assert store.book.verified(entry.id)
    await shared.heard(HeadsGone("a", (entry.id,)))
    assert store.book.entry(entry.id) is None and not store.book.path(entry.id).exists()
    await store.close()


@pytest.mark.asyncio
async def test_a_head_of_other_tenants_or_a_damaged_file_is_not_taken(tmp_path: Path) -> None:
    store, shared = _store(tmp_path, "b", {"key-1": "alpha"})
    entry, path = _saved(tmp_path)
    news = HeadSaved("a", entry.id, entry.to_json(), str(path), tenants_digest({"key-1": "beta"}))
    await shared.heard(news)  # the same key names another project there: its chains are not this proxy's
    assert store.book.heads() == []
    mine = tenants_digest({"key-1": "alpha"})
    path.write_bytes(b"kV" * 500)  # flipped after its checksum was taken
    await shared.heard(HeadSaved("a", entry.id, entry.to_json(), str(path), mine))
    assert store.book.heads() == [] and list(store.book.dir.glob("*.head")) == []
    await shared.heard(HeadSaved("a", "../../x", {**entry.to_json(), "id": "../../x"}, str(path), mine))
    assert store.book.heads() == []
    await store.close()


@pytest.mark.asyncio
async def test_a_verdict_told_is_heard_by_the_planner(tmp_path: Path) -> None:
    store, shared = _store(tmp_path, "b")
    await shared.heard(HeadInert("a", "http://10.0.0.1:8080", "00ff00ff00ff00ff00ff00ff", 3600.0, 600.0))
    assert store.describe()["inert_servers"] == ["http://10.0.0.1:8080"]
    await store.close()


@pytest.mark.asyncio
async def test_a_head_gone_from_the_other_folder_meanwhile_is_skipped_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store, shared = _store(tmp_path, "b")
    entry, path = _saved(tmp_path)
    path.unlink()  # evicted there after it was told (read back by a proxy that starts listening)
    await shared.heard(HeadSaved("a", entry.id, entry.to_json(), str(path), tenants_digest({})))
    assert store.book.heads() == [] and not [r for r in caplog.records if r.levelname == "WARNING"]
    await store.close()
