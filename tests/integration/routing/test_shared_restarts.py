"""Two `serve` processes sharing one real redis-server (`--shared-state`) and one real llama-server (the tiny
random-weight model, one slot): a restore one proxy finds inert is not tried there by the other."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.processes.redis import RedisServer
from tests.support.processes.servers import ProxyProcess, body_record, chat_record, http_json, wait_until
from tests.support.shared_proxies import MESSAGES, heads_listed, one_slot_server, proxies


class Restartable:
    """The server, stopped and started again on its port at will (as a supervisor that is not `serve` does)."""

    def __init__(self, binary: str, model: Path, work: Path) -> None:
        self.binary, self.model, self.work = binary, model, work
        self.now = one_slot_server(binary, model, work)
        self.url = self.now.url

    def stop(self) -> None:
        self.now.stop()

    def start(self) -> None:
        self.now = one_slot_server(self.binary, self.model, self.work, port=self.now.port)


@pytest.fixture
def server(llama_server_binary: str, tiny_gguf: Path, tmp_path: Path) -> Iterator[Restartable]:
    started = Restartable(llama_server_binary, tiny_gguf, tmp_path)
    yield started
    started.stop()


def _counts(proxy: ProxyProcess) -> dict[str, int]:
    return dict(http_json(proxy.base + "/adaptive/heads")["counts"])


def _erase_directly(server: Restartable) -> None:
    http_json(f"{server.url}/slots/0?action=erase", {})


def test_a_restore_one_proxy_found_inert_is_not_tried_by_the_other(
    server: Restartable, redis_server: RedisServer, tmp_path: Path
) -> None:
    a, b = proxies(server.url, tmp_path / "slots", tmp_path, "--shared-state", redis_server.url)
    try:
        chat_record(a, MESSAGES, 4, **{"x-session-id": "first"})
        heads_listed(a, 1)
        heads_listed(b, 1)
        http_json(a.base + "/adaptive/profiles/plain/erase", {})  # a knows the head is not held in the slot any more
        # The head restored for a new session whose request then reuses nothing of it: llama-server is asked not to
        # reuse a slot's cache (`cache_prompt` false), as a server that loses what it restored (llama.cpp #26676).
        body = {"model": "m", "messages": MESSAGES, "temperature": 0, "max_tokens": 4, "cache_prompt": False}
        unused = body_record(a, body, {"x-session-id": "second"})
        assert "warm: head of" in unused["reason"] and unused["timings"]["cache_n"] < 10, unused
        wait_until(lambda: _counts(a).get("inert") == 1, 10, "a's verdict")
        wait_until(lambda: _counts(b).get("inert_heard") == 1, 10, "b to hear a's verdict")
        _erase_directly(server)
        after = chat_record(b, MESSAGES, 4, **{"x-session-id": "third"})
        assert "warm: head of" not in after["reason"], (after["reason"], b.log())
        assert after["timings"]["cache_n"] < 10, after["timings"]
        assert _counts(b)["restored"] == 0
    finally:
        for proxy in (a, b):
            proxy.stop()
