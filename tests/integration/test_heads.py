"""Warm starts on a REAL llama-server (tiny model, one slot): a session's first turn leaves a head in the store, a
new session's first turn gets it restored into its slot (`cache_n` says so), and so does the first turn after the
proxy is rebuilt from the same state (a restart); the sweep of left-over slot files leaves heads alone."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer

from adaptive_spec.common.headers import REQUEST_ID_HEADER
from adaptive_spec.kv.heads.store import HeadsConfig, HeadStore
from adaptive_spec.requests.app_keys import KV
from adaptive_spec.requests.heads import HEADS
from adaptive_spec.server.app import KvSetup, ProxySettings, build_app
from adaptive_spec.servers.upstreams import Upstream, UpstreamTable
from adaptive_spec.sessions.drafter import NgramParams
from adaptive_spec.sessions.service import SessionService
from adaptive_spec.sessions.statistics import ContextTracker
from tests.support.servers import LlamaServer, free_port

pytestmark = pytest.mark.asyncio(loop_scope="function")

SYSTEM = "You are a coding agent. Rules:\n" + "\n".join(
    f"{i}. Keep function_{i} small, typed and tested; never edit file_{i}.py without reading it." for i in range(40)
)


@pytest.fixture(scope="module")
def server(
    llama_server_binary: str, tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LlamaServer, Path]]:
    home = tmp_path_factory.mktemp("heads")
    slots = home / "slots"
    slots.mkdir()
    llama = LlamaServer(
        llama_server_binary,
        tiny_gguf,
        "-c",
        "8192",
        "--parallel",
        "1",
        "--spec-type",
        "none",
        "--slot-save-path",
        str(slots),
        log_dir=home,
    )
    yield llama, home
    llama.stop()


async def _proxy(llama: LlamaServer, home: Path, max_bytes: int = 2**31) -> TestServer:
    kv = KvSetup(slot_dir=home / "slots", heads=HeadsConfig(home / "state" / "heads", max_bytes))
    sessions = SessionService(ContextTracker(NgramParams()), None)
    app = build_app(UpstreamTable([Upstream("p", llama.url)]), ProxySettings(), sessions, kv=kv)
    proxy = TestServer(app, port=free_port())
    await proxy.start_server()
    return proxy


@pytest_asyncio.fixture(loop_scope="function")
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def _chat(client: aiohttp.ClientSession, proxy: TestServer, session: str, user: str) -> dict[str, Any]:
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        "max_tokens": 4,
        "temperature": 0,
    }
    async with client.post(proxy.make_url("/v1/chat/completions"), json=body, headers={"x-session-id": session}) as r:
        assert r.status == 200, await r.text()
        answer: dict[str, Any] = await r.json()
        request_id = r.headers[REQUEST_ID_HEADER]
    for _ in range(200):  # the record is kept just after the answer's last byte
        async with client.get(proxy.make_url("/adaptive/requests")) as r:
            records = [x for x in (await r.json())["requests"] if x["request_id"] == request_id]
        if records:
            return {"timings": answer["timings"], "record": records[0]}
        await asyncio.sleep(0.05)
    raise AssertionError(f"no record of request {request_id}")


async def _erase(client: aiohttp.ClientSession, llama: LlamaServer) -> None:
    """Another session took the slot: it holds nothing of the head."""
    async with client.post(f"{llama.url}/slots/0?action=erase") as r:
        assert r.status == 200


def _store(proxy: TestServer) -> HeadStore:
    return proxy.app[HEADS]


async def test_a_head_is_saved_and_restored_into_a_new_session_and_after_a_restart(
    server: tuple[LlamaServer, Path], client: aiohttp.ClientSession
) -> None:
    llama, home = server
    proxy = await _proxy(llama, home)
    try:
        cold = await _chat(client, proxy, "first", "Write hello.py.")
        assert cold["timings"]["cache_n"] < 10
        await _store(proxy).settled()
        heads = _store(proxy).describe()["heads"]
        assert len(heads) == 1, _store(proxy).describe()
        head_tokens = heads[0]["tokens"]
        assert head_tokens >= 256
        files = list((home / "state" / "heads").glob("*.head"))
        assert len(files) == 1 and stat.S_IMODE(files[0].stat().st_mode) == 0o600
        assert list((home / "slots").iterdir()) == []  # nothing left where llama-server (and the sweeps) look

        # A new session, same system prompt, another first message: its slot was taken meanwhile.
        await _erase(client, llama)
        warm = await _chat(client, proxy, "second", "Write bye.py.")
        assert "warm: head of" in warm["record"]["reason"], warm["record"]
        assert warm["timings"]["cache_n"] > head_tokens // 2, warm
        assert _store(proxy).describe()["counts"]["restored"] == 1
    finally:
        await proxy.close()

    # The proxy restarts (a new app on the same state directory): the head is found again and restored whole.
    await _erase(client, llama)
    proxy = await _proxy(llama, home)
    try:
        again = await _chat(client, proxy, "third", "Write hello.py.")
        assert "warm: head of" in again["record"]["reason"], again["record"]
        assert again["timings"]["cache_n"] >= head_tokens - 1, again
        async with client.get(proxy.make_url("/adaptive/heads")) as r:
            listed = await r.json()
        assert listed["enabled"] and listed["heads"][0]["restores"] == 2 and listed["heads"][0]["tokens"] == head_tokens
    finally:
        await proxy.close()


async def test_sweeps_leave_heads_alone_and_delete_removes_them(
    server: tuple[LlamaServer, Path], client: aiohttp.ClientSession
) -> None:
    llama, home = server
    proxy = await _proxy(llama, home)
    try:
        await _chat(client, proxy, "sweep-1", "Explain the rules.")
        await _store(proxy).settled()
        files = list((home / "state" / "heads").iterdir())
        assert files
        for path in files:  # as old as any left-over slot file the sweep removes
            os.utime(path, (1.0, 1.0))
        proxy.app[KV].sweep()
        assert sorted((home / "state" / "heads").iterdir()) == sorted(files)
        async with client.delete(proxy.make_url("/adaptive/heads")) as r:
            assert r.status == 200 and (await r.json())["removed"] >= 1
        assert list((home / "state" / "heads").glob("*.head")) == []
        async with client.delete(proxy.make_url("/adaptive/heads/nosuchhead")) as r:
            assert r.status == 404
    finally:
        await proxy.close()


async def test_the_bound_evicts_the_least_recently_used_head(
    server: tuple[LlamaServer, Path], client: aiohttp.ClientSession
) -> None:
    llama, home = server
    proxy = await _proxy(llama, home, max_bytes=1)  # smaller than any head: each save is evicted at once
    try:
        await _chat(client, proxy, "tiny-store", "Summarise the rules in one line.")
        await _store(proxy).settled()
        described = _store(proxy).describe()
        assert described["heads"] == [] and described["counts"]["evicted"] >= 1, described
        assert list((home / "state" / "heads").glob("*.head")) == []
    finally:
        await proxy.close()
