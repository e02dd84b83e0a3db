"""A slot action on a connection the server drops before answering (a keep-alive connection it had just closed) is
sent once more; a server that keeps dropping it is an error. llama-server cannot be made to drop a connection on
demand, so a socket server stands in for it here; the erase itself is tested on a real server
(tests/integration/server/test_one_server.py)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from adaptive_spec.kv.slots import slot_action
from adaptive_spec.llama.upstreams import Upstream

ANSWER = b'{"id_slot": 0, "n_erased": 12}'


async def _server(drops: int) -> tuple[asyncio.Server, list[bytes]]:
    """Drops the first `drops` requests unanswered (after reading them), answers the rest."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                (int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")), 0
            )
            await reader.readexactly(length)
            seen.append(head.split(b"\r\n")[0])
            if len(seen) <= drops:
                writer.close()
                return
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(ANSWER)
            )
            writer.write(ANSWER)
            await writer.drain()

    return await asyncio.start_server(handle, "127.0.0.1", 0), seen


@pytest.mark.asyncio
@pytest.mark.parametrize("drops", [1, 2])
async def test_a_slot_action_dropped_before_its_answer_is_sent_once_more(drops: int) -> None:
    server, seen = await _server(drops)
    port = server.sockets[0].getsockname()[1]
    upstream = Upstream("oneshot", f"http://127.0.0.1:{port}")
    timeout = aiohttp.ClientTimeout(total=5)
    async with server, aiohttp.ClientSession() as client:
        if drops == 1:
            answer = await slot_action(client, upstream, 0, "erase", None, timeout)
            assert answer == {"id_slot": 0, "n_erased": 12}
        else:
            with pytest.raises(aiohttp.ServerDisconnectedError):
                await slot_action(client, upstream, 0, "erase", None, timeout)
    assert seen == [b"POST /slots/0?action=erase HTTP/1.1"] * 2
