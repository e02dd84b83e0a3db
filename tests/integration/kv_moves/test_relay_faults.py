"""A malicious or broken kv-relay, which the real one cannot be made to be, faked in process: whatever it announces,
sends or says, the proxy's remote prefill writes nothing outside its slot directory, keeps no partial file, fills
no disk beyond the size the relay said it saved, gives up at its deadline and prefills here, with a short clean
reason. And the real relay in front of a faked llama-server that loses a race the real one cannot be made to lose."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

from adaptive_spec.access.rules import AccessPolicy
from adaptive_spec.kv.effects import KvEffects
from adaptive_spec.kv.relay_client import RelayClient
from adaptive_spec.kv.remote_prefill.pricing import RemoteCosts, RemotePrefillPolicy
from adaptive_spec.kv.remote_prefill.shell import RemotePrefill
from adaptive_spec.kv.slot_files import MODEL_HEADER
from adaptive_spec.llama.upstreams import Upstream, UpstreamTable
from adaptive_spec.relay.prefill import ROUTES, client_ctx
from adaptive_spec.relay.service import RelaySettings, build_relay_app
from adaptive_spec.routing.contract import FixedPolicy
from adaptive_spec.routing.decision import Decision
from adaptive_spec.routing.router import Router
from adaptive_spec.telemetry.events import Event, RemotePrefillDone
from tests.support.fakes.fake_upstream import FakeUpstream, Handler
from tests.support.recorded import recorded
from tests.support.routing import request, routed

pytestmark = pytest.mark.asyncio(loop_scope="function")
SAVED = 4096  # what the fake relay says its server wrote
DATA = bytes(range(256)) * (SAVED // 256)


class EvilRelay:
    """One fault per test, chosen by `fault`."""

    def __init__(self, fault: str) -> None:
        self.fault = fault
        self.deleted: list[str] = []

    async def prefill(self, request: web.Request) -> web.StreamResponse:
        if self.fault == "stall-prefill":
            await asyncio.sleep(60)
        if self.fault == "rant":
            message = "\x1b[2J" + "no\n" * 100_000
            return web.json_response({"error": {"message": message, "type": "x", "code": "x"}}, status=500)
        saved = 1 << 40 if self.fault == "claims-a-terabyte" else SAVED
        # Names and paths in the answer are the relay's to invent; the proxy must not use them.
        return web.json_response(
            {"slot": 0, "timings": {"prompt_n": 100}, "n_saved": 100, "n_written": saved, "filename": "../../x.bin"}
        )

    async def download(self, request: web.Request) -> web.StreamResponse:
        sha = "0" * 64 if self.fault == "wrong-sha" else hashlib.sha256(DATA).hexdigest()
        resp = web.StreamResponse(headers={"x-adaptive-spec-sha256": sha})
        if self.fault == "huge-content-length":
            resp.content_length = 1 << 40
        elif self.fault not in ("endless", "drip"):
            resp.content_length = len(DATA)
        await resp.prepare(request)
        if self.fault == "endless":  # until the proxy cuts it off (what is asserted), or 60 s at the most
            deadline = asyncio.get_running_loop().time() + 60
            while asyncio.get_running_loop().time() < deadline:
                await resp.write(DATA)
        if self.fault == "drip":
            await resp.write(DATA[:1])
            await asyncio.sleep(60)
        await resp.write(DATA)
        return resp

    async def delete(self, request: web.Request) -> web.Response:
        self.deleted.append(request.match_info["name"])
        return web.Response(status=204)


@pytest_asyncio.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as client:
        yield client


async def _serve(relay: EvilRelay) -> FakeUpstream:
    routes: dict[tuple[str, str], Handler] = {
        ("POST", "/relay/prefill"): relay.prefill,
        ("GET", "/relay/slots/{name}"): relay.download,
        ("DELETE", "/relay/slots/{name}"): relay.delete,
    }
    server = FakeUpstream(routes=routes)
    await server.start()
    return server


async def _attempt(
    fault: str, home: Path, client: aiohttp.ClientSession
) -> tuple[Decision, RemotePrefillDone, EvilRelay]:
    relay = EvilRelay(fault)
    server = await _serve(relay)
    slot_dir = home / "slots"
    slot_dir.mkdir()
    events: list[Event] = []
    costs = RemoteCosts(RemotePrefillPolicy(force=True))
    remote = RemotePrefill(RelayClient(server.url, "k", "a" * 64), costs, slot_dir, min_deadline_s=2.0)
    table = UpstreamTable([Upstream("main", "http://127.0.0.1:9")])
    effects = KvEffects(table, lambda: client, events.append, slot_dir, remote=remote)
    router = Router(table, FixedPolicy(), {"main": 1}, {"main": ("none",)}, effects)
    # Few tokens: the local prefill's estimate is short, so the deadline is the 2 s floor.
    ask = replace(request({"messages": [{"role": "user", "content": "hi"}]}, "s"), prefill_path="/v1/x")
    try:
        route = await routed(router, ask, effects)
    finally:
        await server.close()
    decided, result = route.decision, route.remote_prefill
    assert result is not None and not result.ok
    assert "prefilled here" in decided.reason
    assert _names(home) == ["slots"] and _names(slot_dir) == []
    assert relay.deleted and all(name.startswith("as-pp-") for name in relay.deleted)
    (event,) = [e for e in events if isinstance(e, RemotePrefillDone)]
    assert event.ok is False and event.reason == result.reason and event.error == result.error
    return decided, event, relay


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        ("claims-a-terabyte", "size"),  # refused before a byte is written
        ("huge-content-length", "size"),  # announced more than the relay said it saved
        ("endless", "size"),  # sends on past the size it said: cut off there
        ("wrong-sha", "checksum"),
    ],
)
async def test_a_relay_cannot_make_the_proxy_write_more_than_it_saved(
    fault: str, reason: str, tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    _, event, _ = await _attempt(fault, tmp_path, session)
    assert event.reason == reason, event.error


@pytest.mark.parametrize("fault", ["stall-prefill", "drip"])
async def test_a_stalled_or_dripping_relay_is_given_up_at_the_deadline(
    fault: str, tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    decided, event, _ = await _attempt(fault, tmp_path, session)
    assert event.reason == "timeout" and "gave up after 2 s" in decided.reason, decided.reason


async def test_a_relays_message_reaches_the_reason_line_short_and_without_control_characters(
    tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    decided, event, _ = await _attempt("rant", tmp_path, session)
    assert event.reason == "relay" and event.error is not None
    assert len(event.error) < 500 and "\x1b" not in event.error and "\n" not in event.error
    assert "\n" not in decided.reason and len(decided.reason) < 1000


def _names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


async def test_a_slot_that_changed_hands_before_the_save_is_not_served(
    tmp_path: Path, session: aiohttp.ClientSession
) -> None:
    """A llama-server shared with other clients (a race a real one cannot be made to lose on demand): between the
    relay's prefill and its save, another request took the slot, so the file holds someone else's conversation."""
    slots = tmp_path / "slots"
    slots.mkdir()
    prefilled = recorded("chat_completion_prefill")
    saved = recorded("slot_save")
    prompt = prefilled["timings"]["prompt_n"] + prefilled["timings"]["cache_n"]
    assert saved["n_saved"] == prompt  # what the real server saves after the prefill alone
    # Not a real server's answer: the race, a slot holding more than this prompt (another request's conversation).
    saved["n_saved"] = prompt + 150

    async def props(_: web.Request) -> web.Response:
        return web.json_response(recorded("props_stock"))

    async def chat(_: web.Request) -> web.Response:
        return web.json_response(prefilled)

    async def save(request: web.Request) -> web.Response:
        name = (await request.json())["filename"]
        (slots / name).write_bytes(b"k" * saved["n_written"])
        return web.json_response({**saved, "filename": name})

    routes: dict[tuple[str, str], Handler] = {
        ("GET", "/props"): props,
        ("POST", "/v1/chat/completions"): chat,
        ("POST", "/slots/0"): save,
    }
    server = FakeUpstream(routes=routes)
    await server.start()
    settings = RelaySettings(
        slot_dir=slots,
        model_name="m.gguf",
        model_bytes=1,
        model_sha256="a" * 64,
        access=AccessPolicy(api_keys=("k",), allowed_hosts=("*",)),
        server_url=server.url,
    )
    app = build_relay_app(settings, ROUTES)
    app.cleanup_ctx.append(client_ctx)
    relay = TestServer(app)
    await relay.start_server()
    try:
        spec = {"path": "/v1/chat/completions", "body": {"messages": []}, "filename": "as-pp-race.bin"}
        headers = {"Authorization": "Bearer k", MODEL_HEADER: "a" * 64}
        async with session.post(relay.make_url("/relay/prefill"), json=spec, headers=headers) as resp:
            status, body = resp.status, await resp.json()
    finally:
        await relay.close()
        await server.close()
    assert status == 502 and body["error"]["code"] == "slot_changed", body
    assert _names(slots) == []
