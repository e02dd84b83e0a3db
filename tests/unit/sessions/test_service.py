"""A session's next turn is routed on the statistics folded so far: it never waits for its previous turn's update
(a whole history to tokenize and index: hundreds of milliseconds on a long first turn)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer

from adaptive_spec.llama.upstreams import Upstream, UpstreamTable
from adaptive_spec.proxy.app import ProxySettings, build_app
from adaptive_spec.requests.app_keys import HISTORY
from adaptive_spec.sessions.ngram_replay import NgramParams
from adaptive_spec.sessions.service import SessionService
from adaptive_spec.sessions.statistics import ContextTracker
from tests.support.fakes.fake_upstream import FakeUpstream

pytestmark = pytest.mark.asyncio(loop_scope="function")


class _StalledTokenizer:
    """Tokenizes only once released: the first turn's statistics update is still running meanwhile."""

    name = "stalled"

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.asked = asyncio.Event()

    async def encode(self, texts: Sequence[str]) -> list[list[int]]:
        self.asked.set()
        await self.release.wait()
        return [[len(t)] for t in texts]


async def _turn(proxy: TestServer, messages: list[dict[str, str]]) -> int:
    body = orjson.dumps({"model": "m", "messages": messages, "stream": True})
    headers = {"x-fault": "done", "x-session-id": "ses_1"}
    async with (
        aiohttp.ClientSession() as client,
        client.post(proxy.make_url("/v1/chat/completions"), data=body, headers=headers) as resp,
    ):
        await resp.read()
        return resp.status


async def test_a_turn_is_routed_while_its_previous_turns_update_still_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = _StalledTokenizer()
    service = SessionService(ContextTracker(NgramParams()), tokenizer)

    async def waited(_session_id: str, _timeout: float) -> bool:
        raise AssertionError("a request waited for its session's statistics")

    monkeypatch.setattr(service, "settled", waited)
    async with FakeUpstream() as fake:
        proxy = TestServer(build_app(UpstreamTable([Upstream("fake", fake.url)]), ProxySettings(), service))
        await proxy.start_server()
        try:
            history = [{"role": "user", "content": "read the file"}]
            assert await _turn(proxy, history) == 200
            await asyncio.wait_for(tokenizer.asked.wait(), 10)  # the first turn's update has started and is stuck
            history += [{"role": "assistant", "content": "tok tok"}, {"role": "user", "content": "now fix it"}]
            assert await asyncio.wait_for(_turn(proxy, history), 10) == 200
            records = proxy.app[HISTORY].latest(2)
            assert [(r.session_id, r.outcome) for r in records] == [("ses_1", "finished")] * 2
            assert service.update_counts()["processed"] == 0  # routed before the first turn was folded in
            assert service.copy_state("ses_1") == (0, None)  # ... on what was folded by then: nothing yet
        finally:
            tokenizer.release.set()
            await proxy.close()
