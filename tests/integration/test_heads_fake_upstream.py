"""Head store faults a real llama-server does not produce on demand, against an in-process fake of its slot API: a
save answered "Unable to save slot" (its disk full), and restores that report success while the next prompt reuses
nothing (`cache_n` 0, as llama.cpp #26676 did): learned once per server and not tried there again."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.support.heads import chat, erase, start_proxy, store_of
from tests.support.servers import free_port

pytestmark = pytest.mark.asyncio(loop_scope="function")
PROMPT_TOKENS = 900


@dataclass
class FakeSlots:
    """llama-server's /props, /slots, slot actions and chat completions, as far as the store uses them."""

    slot_dir: Path
    save_fails: bool = False
    actions: list[str] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/props", self._props)
        app.router.add_get("/slots", self._slots)
        app.router.add_get("/health", self._health)
        app.router.add_post("/slots/{slot}", self._action)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _props(self, _: web.Request) -> web.Response:
        settings = {"n_ctx": 8192}
        return web.json_response(
            {"model_path": "fake.gguf", "total_slots": 1, "default_generation_settings": settings, "build_info": "b1"}
        )

    async def _slots(self, _: web.Request) -> web.Response:
        return web.json_response([{"id": 0, "is_processing": False, "n_ctx": 8192}])

    async def _action(self, request: web.Request) -> web.Response:
        action, body = request.query["action"], await request.json() if request.can_read_body else {}
        self.actions.append(action)
        if action == "save" and self.save_fails:
            error = {"code": 500, "message": "Unable to save slot", "type": "server_error"}
            return web.json_response({"error": error}, status=500)
        if action == "save":
            (self.slot_dir / body["filename"]).write_bytes(b"kv" * 600_000)
            return web.json_response({"id_slot": 0, "filename": body["filename"], "n_saved": PROMPT_TOKENS + 4})
        if action == "restore":
            return web.json_response({"id_slot": 0, "filename": body["filename"], "n_restored": PROMPT_TOKENS + 4})
        return web.json_response({"id_slot": 0, "n_erased": 0})

    async def _chat(self, _: web.Request) -> web.Response:
        timings = {"prompt_n": PROMPT_TOKENS, "cache_n": 0, "predicted_n": 2, "prompt_ms": 9000.0, "predicted_ms": 40.0}
        choice = {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        usage = {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 2, "total_tokens": PROMPT_TOKENS + 2}
        return web.json_response({"choices": [choice], "usage": usage, "timings": timings, "object": "chat.completion"})


@pytest_asyncio.fixture(loop_scope="function")
async def fake(tmp_path: Path) -> AsyncIterator[tuple[FakeSlots, TestServer]]:
    (tmp_path / "slots").mkdir()
    slots = FakeSlots(tmp_path / "slots")
    server = TestServer(slots.app(), port=free_port())
    await server.start_server()
    yield slots, server
    await server.close()


@pytest_asyncio.fixture(loop_scope="function")
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def _url(server: TestServer) -> str:
    return str(server.make_url("")).rstrip("/")


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    assert not [r for r in caplog.records if r.exc_info]  # a reason in one line, no traceback
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


async def test_unable_to_save_slot_costs_the_head_not_the_request(
    fake: tuple[FakeSlots, TestServer], client: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    slots, server = fake
    slots.save_fails = True
    proxy = await start_proxy(_url(server), slots.slot_dir, tmp_path / "heads")
    try:
        answer = await chat(client, proxy, "s1", "Write hello.py.")
        await store_of(proxy).settled()
        assert answer["text"] == "ok" and "save" in slots.actions
        described = store_of(proxy).describe()
        assert described["counts"]["failed"] == 1 and described["heads"] == [], described
        assert any("Unable to save slot" in m for m in _warnings(caplog)), caplog.records
        assert list(slots.slot_dir.iterdir()) == [] and list((tmp_path / "heads").glob("*.head")) == []
    finally:
        await proxy.close()


async def test_an_inert_restore_is_learned_per_server_and_not_repeated(
    fake: tuple[FakeSlots, TestServer], client: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    slots, server = fake
    proxy = await start_proxy(_url(server), slots.slot_dir, tmp_path / "heads")
    try:
        await chat(client, proxy, "s1", "Write hello.py.")
        await store_of(proxy).settled()
        assert len(store_of(proxy).describe()["heads"]) == 1
        await erase(client, proxy)
        restored = await chat(client, proxy, "s2", "Write hello.py.")  # restored, and then reused nothing
        assert "warm: head of" in restored["record"]["reason"] and slots.actions.count("restore") == 1
        assert store_of(proxy).describe()["inert_servers"] == [_url(server)]
        assert any("no more restores there" in m for m in _warnings(caplog))
        await erase(client, proxy)
        again = await chat(client, proxy, "s3", "Write hello.py.")
        assert "warm:" not in again["record"]["reason"] and slots.actions.count("restore") == 1, slots.actions
    finally:
        await proxy.close()
