"""Head store faults a real llama-server does not produce on demand, against an in-process fake of its slot API: a
save answered "Unable to save slot" (its disk full), restores that report success while the next prompt reuses
nothing (`cache_n` 0, as llama.cpp #26676 did): learned once per server and not tried there again; a slot action the
server deferred behind a request that came meanwhile; a save of a slot that held more than the turn, of an unknown
slot among several, or written short; a restore refused; a hung `/slots`; warm starts with project keys."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

from adaptive_spec.kv.heads.server import idle_slots
from adaptive_spec.kv.heads.values import SavedTurn
from adaptive_spec.kv.moves import AfterTurn, HeadSave, SlotAt
from adaptive_spec.llama.upstreams import Upstream
from adaptive_spec.requests.app_keys import ROUTER
from tests.support.heads import chat, erase, restore, start_proxy, store_of
from tests.support.processes.servers import free_port

pytestmark = pytest.mark.asyncio(loop_scope="function")
PROMPT_TOKENS = 900


@dataclass
class FakeSlots:
    """llama-server's /props, /slots, slot actions and chat completions, as far as the store uses them."""

    slot_dir: Path
    save_fails: bool = False
    restore_fails: bool = False
    n_slots: int = 1
    n_saved: int = PROMPT_TOKENS + 4
    n_written: int | None = None  # reported in a save's answer (None: not reported)
    slots_hang: bool = False
    during: Callable[[str], Awaitable[None]] | None = None  # runs inside each slot action, before its answer
    busy_polls: int = 0  # the next `/slots` answers say a slot is processing (`on_busy` runs in each)
    on_busy: Callable[[], None] | None = None
    actions: list[str] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/props", self._props)
        app.router.add_get("/slots", self._slots)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/slots/{slot}", self._action)
        app.router.add_post("/v1/chat/completions", self._chat)
        return app

    async def _health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _props(self, _: web.Request) -> web.Response:
        settings = {"n_ctx": 8192}
        model = self.slot_dir.parent / "fake.gguf"  # a file the store can read, and know by content
        if not model.exists():
            model.write_bytes(b"GGUF fake weights")
        return web.json_response(
            {"model_path": str(model), "total_slots": 1, "default_generation_settings": settings, "build_info": "b1"}
        )

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(text="llamacpp:prompt_tokens_total 0\n")  # fresh: it has prefilled nothing

    async def _slots(self, _: web.Request) -> web.Response:
        if self.slots_hang:
            await asyncio.sleep(30)
        busy = self.busy_polls > 0
        if busy:
            self.busy_polls -= 1
            if self.on_busy is not None:
                self.on_busy()
        return web.json_response([{"id": i, "is_processing": busy, "n_ctx": 8192} for i in range(self.n_slots)])

    async def _action(self, request: web.Request) -> web.Response:
        action, body = request.query["action"], await request.json() if request.can_read_body else {}
        self.actions.append(action)
        if self.during is not None:
            await self.during(action)
        if action == "restore" and self.restore_fails:
            error = {"code": 400, "message": "failed to restore slot", "type": "invalid_request_error"}
            return web.json_response({"error": error}, status=400)
        if action == "save" and self.save_fails:
            error = {"code": 500, "message": "Unable to save slot", "type": "server_error"}
            return web.json_response({"error": error}, status=500)
        if action == "save":
            (self.slot_dir / body["filename"]).write_bytes(b"kv" * 600_000)
            answer = {"id_slot": 0, "filename": body["filename"], "n_saved": self.n_saved}
            return web.json_response(answer if self.n_written is None else {**answer, "n_written": self.n_written})
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


async def test_an_inert_restore_is_learned_per_head_and_not_repeated(
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
        assert any("that head is not restored there for an hour" in m for m in _warnings(caplog))
        assert store_of(proxy).describe()["inert_servers"] == []  # one head: the server's restores go on
        await erase(client, proxy)
        again = await chat(client, proxy, "s3", "Write hello.py.")
        assert "warm:" not in again["record"]["reason"] and slots.actions.count("restore") == 1, slots.actions
    finally:
        await proxy.close()


async def test_a_slot_action_deferred_behind_a_request_that_came_meanwhile_is_not_trusted(
    fake: tuple[FakeSlots, TestServer], client: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """llama-server defers a slot action while a slot is busy, then acts on what the slot holds then: another
    request's KV. A save then is not kept; after a restore the router is told the server's slots are emptied."""
    slots, server = fake
    proxy = await start_proxy(_url(server), slots.slot_dir, tmp_path / "heads")
    store = store_of(proxy)
    erased: list[tuple[str, int]] = []
    router = proxy.app[ROUTER]
    forget = router.slots_erased

    def slots_erased(profile: str, replica: int = 0) -> None:  # watched, and still done: the router forgets the slot
        erased.append((profile, replica))
        forget(profile, replica)

    router.slots_erased = slots_erased  # type: ignore[method-assign]

    async def a_request_comes(action: str) -> None:
        if action in ("save", "restore"):
            store.forwarded(Upstream("p", _url(server)))

    try:
        slots.during = a_request_comes
        await chat(client, proxy, "s1", "Write hello.py.")
        await store.settled()
        assert slots.actions.count("save") == 1 and store.describe()["heads"] == [] and store.counts["failed"] == 1
        assert any("a request came during the save" in m for m in _warnings(caplog))
        assert list(slots.slot_dir.iterdir()) == [] and list((tmp_path / "heads").glob("*.head")) == []

        slots.during = None
        await chat(client, proxy, "s2", "Write hello.py.")
        await store.settled()
        assert len(store.describe()["heads"]) == 1 and erased == []
        await erase(client, proxy)
        erased.clear()
        slots.during = a_request_comes
        warm = await chat(client, proxy, "s3", "Write hello.py.")
        assert "warm: head of" in warm["record"]["reason"] and erased == [("p", 0)], (warm["record"], erased)
    finally:
        await proxy.close()


async def test_a_first_turn_is_not_saved_after_another_request_used_its_slot_while_the_save_waited(
    fake: tuple[FakeSlots, TestServer], client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Tenant A's first turn ends; tenant B's request is forwarded to the same one-slot server and runs while A's save
    waits for the server to go idle. The slot then holds B's KV: it must not be kept under A's prompt (A's later
    sessions would restore B's tokens, and `cache_n` would tell A how far a probe matches B's prompt)."""
    slots, server = fake
    proxy = await start_proxy(_url(server), slots.slot_dir, tmp_path / "heads")
    store = store_of(proxy)
    try:
        slots.busy_polls = 1  # the save's first look finds B being served...
        slots.on_busy = lambda: store.forwarded(Upstream("p", _url(server)))  # ...B having been forwarded
        await chat(client, proxy, "a1", "Write hello.py.")
        await store.settled()
        assert "save" not in slots.actions and store.describe()["heads"] == [], slots.actions
        assert list((tmp_path / "heads").glob("*.head")) == []
        slots.on_busy = None
        await chat(client, proxy, "a2", "Write hello.py.")  # nothing came after this one: it is kept
        await store.settled()
        assert slots.actions.count("save") == 1 and len(store.describe()["heads"]) == 1, slots.actions
    finally:
        await proxy.close()


@pytest.mark.parametrize("fault", ["more_than_the_turn", "unknown_slot_of_two", "written_short", "none"])
async def test_a_save_is_kept_only_from_the_requests_own_slot_whole(
    fake: tuple[FakeSlots, TestServer], client: aiohttp.ClientSession, tmp_path: Path, fault: str
) -> None:
    """Served with slot None on a server of two slots, or a slot that held more than the turn's prompt and reply
    (another request's KV after it), or a file shorter than llama-server says it wrote: nothing is kept."""
    slots, server = fake
    slots.n_slots = 2 if fault == "unknown_slot_of_two" else 1
    slots.n_saved = 5000 if fault == "more_than_the_turn" else PROMPT_TOKENS + 4
    slots.n_written = 999 if fault == "written_short" else 1_200_000
    proxy = await start_proxy(_url(server), slots.slot_dir, tmp_path / "heads")
    store = store_of(proxy)
    try:
        upstream, pieces = Upstream("p", _url(server)), [b"system".ljust(16), b"user".ljust(16)]
        turn = SavedTurn(tuple(pieces), (3000, 100), PROMPT_TOKENS, 2, "agent", "default", "")
        store.after_turn(upstream, AfterTurn("", 0, save=HeadSave(SlotAt("p", 0, None), upstream.base_url, turn, None)))
        await store.settled()
        kept = len(store.describe()["heads"])
        assert kept == (1 if fault == "none" else 0), (fault, store.describe())
        assert ("save" in slots.actions) == (fault != "unknown_slot_of_two"), slots.actions
        assert list(slots.slot_dir.iterdir()) == []
    finally:
        await proxy.close()


async def test_a_refused_restore_keeps_the_head_and_a_new_save_replaces_it(
    fake: tuple[FakeSlots, TestServer], client: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """Its checksum holds: llama-server's refusal costs that server's restores of it this run, not the head."""
    slots, server = fake
    proxy = await start_proxy(_url(server), slots.slot_dir, tmp_path / "heads")
    store = store_of(proxy)
    try:
        await chat(client, proxy, "s1", "Write hello.py.")
        await store.settled()
        (head,) = store.describe()["heads"]
        slots.restore_fails = True
        await erase(client, proxy)
        refused = await chat(client, proxy, "s2", "Write hello.py.")
        await store.settled()
        assert "warm:" not in refused["record"]["reason"] and slots.actions.count("restore") == 1
        assert store.counts["removed"] == 0 and any("failed to restore slot" in m for m in _warnings(caplog))
        assert [h["id"] for h in store.describe()["heads"]] == [head["id"]]
        assert slots.actions.count("save") == 2  # not counted as covering the prompt: saved again, replaced
        slots.restore_fails = False
        await erase(client, proxy)
        warm = await chat(client, proxy, "s3", "Write hello.py.")  # the new file restores
        assert "warm: head of" in warm["record"]["reason"] and slots.actions.count("restore") == 2
    finally:
        await proxy.close()


async def test_a_restore_waits_for_the_store_a_bounded_time_and_never_for_a_hung_server(
    fake: tuple[FakeSlots, TestServer], client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    slots, server = fake
    proxy = await start_proxy(_url(server), slots.slot_dir, tmp_path / "heads")
    store = store_of(proxy)
    upstream = Upstream("p", _url(server))
    try:
        await chat(client, proxy, "s1", "Write hello.py.")
        await store.settled()
        async with store._lock:  # a save or another restore under way that outlasts the wait: nothing restored
            assert await restore(store, upstream, 0, [b"system".ljust(16)]) is None
        assert "restore" not in slots.actions
        slots.slots_hang = True  # `/slots` unanswered: busy, after ASK_TIMEOUT, not an error
        assert await idle_slots(client, upstream, 0.0) is None
    finally:
        slots.slots_hang = False
        await proxy.close()


@pytest.mark.parametrize("project_keys", [{}, {"key-a": "team-a"}])
async def test_with_project_keys_a_fresh_server_is_not_warm_started(
    fake: tuple[FakeSlots, TestServer], client: aiohttp.ClientSession, tmp_path: Path, project_keys: dict[str, str]
) -> None:
    """A slot warmed with a head would serve its KV to whichever project's request lands there."""
    slots, server = fake
    proxy = await start_proxy(_url(server), slots.slot_dir, tmp_path / "heads")
    try:
        await chat(client, proxy, "s1", "Write hello.py.")
        await store_of(proxy).settled()
    finally:
        await proxy.close()
    slots.actions.clear()
    proxy = await start_proxy(_url(server), slots.slot_dir, tmp_path / "heads", project_keys=project_keys)
    try:
        await store_of(proxy).settled()  # the warm start at start, in the background
        assert slots.actions.count("restore") == (0 if project_keys else 1), slots.actions
        assert store_of(proxy).counts["warm_started"] == (0 if project_keys else 1)
    finally:
        await proxy.close()


async def test_a_restore_on_a_hung_server_gives_up_at_its_files_pace_and_the_request_goes_on(
    fake: tuple[FakeSlots, TestServer], client: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """The server hangs in the restore (its /slots answered): the request waits 5 s + the file's size at 50 MB/s,
    not the 60 s a save may take. The bound below is generous (a shared machine); 60 s would pass it."""
    slots, server = fake
    proxy = await start_proxy(_url(server), slots.slot_dir, tmp_path / "heads")
    store = store_of(proxy)

    async def hang(action: str) -> None:
        if action == "restore":
            await asyncio.sleep(120)

    try:
        await chat(client, proxy, "s1", "Write hello.py.")
        await store.settled()
        await erase(client, proxy)
        slots.during = hang
        cold = await asyncio.wait_for(chat(client, proxy, "s2", "Write hello.py."), 45)
        assert "warm:" not in cold["record"]["reason"] and store.counts["failed"] == 1, cold["record"]
        assert store.counts["removed"] == 0 and len(store.describe()["heads"]) == 1
    finally:
        await proxy.close()
