"""What resets an agent's stream guard, with the real agent (opt-in, as tests/e2e/test_agents.py): Qwen Code with plain
settings but its idle guard shortened, through the proxy app, in front of a server that sends its 200 headers at once
and then, for longer than the guard, nothing but SSE comments (as llama-server b11549 does while it prefills: a `:`
line after each 30 s without a result, its `--sse-ping-interval`).

Qwen Code 0.24.4 times the gap between the chunks its OpenAI SDK yields (`withStreamGuards`, wrapped around the SDK's
stream before its converter drops a chunk without choices): every `data:` JSON event is one, an SSE comment is none.
The proxy's keep-alive on chat/completions is a chunk with no choices, and it goes on past the server's comments
(which it drops) until the first event, so the guard never fires however long the prefill: the first turn is answered
the first time, no attempt given up on (examples/README.md has every agent's timers). A silence this long is a fault
a real server cannot be made to produce on demand: the in-process fake upstream stands in for it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

from adaptive_spec.llama.upstreams import Upstream, UpstreamTable
from adaptive_spec.proxy.app import ProxySettings, build_app
from adaptive_spec.requests.app_keys import HISTORY
from tests.support.fakes.fake_upstream import FakeUpstream
from tests.support.processes.agents import client
from tests.support.processes.servers import free_port

GUARD_MS = 3000  # Qwen Code's idle guard, shortened from its 240 s
SILENCE_S = 12.0  # the server's "prefill": four times the guard
INTERVAL_S = 1.0  # the proxy's keep-alive interval

pytestmark = pytest.mark.asyncio(loop_scope="function")


def _chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [choice]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


ANSWER = _chunk({"role": "assistant", "content": None}) + _chunk({"content": "Done."}) + _chunk({}, "stop")


class SilentPrefill:
    """/v1/chat/completions as llama-server b11549 streams a long prefill: the headers at once, then `SILENCE_S` of
    nothing but a comment after its first quarter, then the answer. `bodies`: each request's body, as it came."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(SILENCE_S / 4)
        await resp.write(b":\n\n")
        await asyncio.sleep(SILENCE_S * 3 / 4)
        await resp.write(ANSWER + b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest_asyncio.fixture(loop_scope="function")
async def rig() -> AsyncIterator[tuple[SilentPrefill, TestServer]]:
    server = SilentPrefill()
    async with FakeUpstream(routes={("POST", "/v1/chat/completions"): server.handle}) as fake:
        settings = ProxySettings(read_timeout_s=SILENCE_S * 4, prefill_keepalive_s=INTERVAL_S)
        proxy = TestServer(build_app(UpstreamTable([Upstream("fake", fake.url)]), settings), port=free_port())
        await proxy.start_server()
        yield server, proxy
        await proxy.close()


async def _qwen(proxy: TestServer, workspace: tuple[Path, dict[str, str]]) -> tuple[int, str, float]:
    """Qwen Code's headless run of one prompt: its exit code, its output, its seconds."""
    repo, env = workspace
    settings = Path(env["HOME"]) / ".qwen" / "settings.json"
    settings.parent.mkdir(parents=True)
    settings.write_text(json.dumps({"usageStatisticsEnabled": False, "telemetry": {"enabled": False}}))
    env = {
        **env,
        "OPENAI_BASE_URL": str(proxy.make_url("/p/guards/v1")),
        "OPENAI_API_KEY": "local",
        "OPENAI_MODEL": "local",
        "QWEN_STREAM_IDLE_TIMEOUT_MS": str(GUARD_MS),
    }
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        str(client("qwen")),
        "--yolo",
        "Say done.",
        cwd=repo,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 300)
    return proc.returncode or 0, out.decode(errors="replace"), time.monotonic() - started


async def test_qwen_codes_idle_guard_waits_out_a_silent_prefill(
    rig: tuple[SilentPrefill, TestServer], workspace: tuple[Path, dict[str, str]]
) -> None:
    server, proxy = rig
    code, out, seconds = await _qwen(proxy, workspace)
    records = [r for r in proxy.app[HISTORY].latest(100) if r.path.endswith("/chat/completions")]
    seen = [(r.status, r.outcome, r.total_ms) for r in records]
    assert code == 0 and "Done." in out, (code, out[-2000:], seen)
    assert server.bodies, out[-2000:]
    # One request per prompt Qwen Code sent: none given up on and sent again (a retry repeats its messages).
    prompts = [json.dumps(body["messages"]) for body in server.bodies]
    assert len(prompts) == len(set(prompts)), (seconds, seen)
    assert all(r.status == 200 and r.outcome == "finished" for r in records), (seconds, seen)
