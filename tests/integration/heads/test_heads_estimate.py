"""The router's estimate of a request answered from a restored head (a REAL llama-server, the tiny model, one slot, no
RAM prompt cache): a second session with the same head is estimated as what it prefills, since the restore is decided
with its route."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio

from tests.support.heads import chat, erase, messages, start_proxy, store_of
from tests.support.processes.servers import LlamaServer

pytestmark = pytest.mark.asyncio(loop_scope="function")


@pytest_asyncio.fixture(loop_scope="function")
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.mark.parametrize("api", ["chat", "messages"])
async def test_a_request_answered_from_a_restored_head_is_estimated_as_what_it_prefills(
    llama_server_binary: str, tiny_gguf: Path, tmp_path: Path, client: aiohttp.ClientSession, api: str
) -> None:
    args = ("-c", "8192", "--parallel", "1", "--cache-ram", "0", "--spec-type", "none", "--slot-save-path")
    llama = LlamaServer(llama_server_binary, tiny_gguf, *args, str(tmp_path), log_dir=tmp_path)
    proxy = await start_proxy(llama.url, tmp_path, tmp_path / "heads")
    send = chat if api == "chat" else messages  # Claude Code's shape: the system prompt apart, `/v1/messages`
    try:
        cold = await send(client, proxy, "first", "Write hello.py.")
        await store_of(proxy).settled()
        await erase(client, proxy)
        warm = await send(client, proxy, "second", "Write hello.py.")
        record = warm["record"]
        assert "warm: head of" in record["reason"] and record["timings"]["prompt_n"] < 16, record
        # The estimate the route was made with counts the restore: what the request prefills, not its whole prompt.
        assert record["new_tokens_est"] <= record["timings"]["prompt_n"] + 16, (record, cold["record"])
        assert cold["record"]["new_tokens_est"] > 256, cold["record"]
    finally:
        await proxy.close()
        llama.stop()
