"""The one fast fake llama-server, for measuring the proxy alone: a real server is far too slow to show the proxy's
own milliseconds. Faults are the other fake's (`tests/support/fakes/fake_upstream.py`); everything else is tested
against a real llama-server.

What it answers, as llama-server does:

    POST /v1/chat/completions   a stream: the role chunk, `max_tokens` content chunks (else `chunks`), each with
                                llama-server's per-token `timings` when the body asks `timings_per_token`, then the
                                final chunk with the answer's timings and [DONE]; `pace_ms` in the body (else
                                `delay_s`) between chunks
    GET /props                  a real stock server's answer (recorded), naming `model_path` (a GGUF on this machine
                                lets the proxy tokenize with its vocabulary, as `serve` does; a path that is not there
                                leaves it llama-server's /tokenize) and `n_ctx`
    GET /slots, /health         recorded; POST /tokenize; GET /v1/models

In-process (`FastUpstream`: the stress scripts), or in a process of its own (`run`), so that its CPU is not the
measured process's (the overhead benchmark).
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import orjson
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.support.processes.servers import free_port
from tests.support.recorded import recorded

PATH = "/v1/chat/completions"
HEAD = {"created": 1796032146, "id": "chatcmpl-9QEQ6deoo8RcQjGdZJzpQMOo943h0b8E", "model": "qwen2.5-coder-0.5b",
        "system_fingerprint": "b11549", "object": "chat.completion.chunk"}  # fmt: skip
MAX_CHUNKS = 1000  # chunks made once; a longer answer repeats them


def content(i: int) -> str:
    """The text of content chunk i."""
    return f" t{i}"


def answer_text(chunks: int) -> str:
    """The whole text of an answer of `chunks` chunks."""
    return "".join(content(i % MAX_CHUNKS) for i in range(chunks))


def timings(n: int) -> dict[str, Any]:
    """llama-server's timings after n tokens, drafting on (the counts are the fake's, not a real server's)."""
    return {"cache_n": 6912, "prompt_n": 21, "prompt_ms": 35.121, "prompt_per_token_ms": 1.6724,
            "prompt_per_second": 597.932, "predicted_n": n, "predicted_ms": 5.31 * n,
            "predicted_per_token_ms": 5.31, "predicted_per_second": 188.323, "draft_n": 2 * n,
            "draft_n_accepted": n - n // 4}  # fmt: skip


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _chunk(i: int, with_timings: bool) -> bytes:
    obj: dict[str, Any] = {"choices": [{"finish_reason": None, "index": 0, "delta": {"content": content(i)}}], **HEAD}
    if with_timings:
        obj["timings"] = timings(i + 1)
    return _event(obj)


CHUNKS = {flag: [_chunk(i, flag) for i in range(MAX_CHUNKS)] for flag in (False, True)}
ROLE = _event(
    {"choices": [{"finish_reason": None, "index": 0, "delta": {"role": "assistant", "content": None}}], **HEAD}
)


class FastUpstream:
    def __init__(
        self,
        *,
        chunks: int = 16,
        delay_s: float = 0.0,
        model_path: str = "/nonexistent/fake.gguf",
        n_ctx: int = 262144,
        slots: int = 4,
    ) -> None:
        self.chunks, self.delay_s = chunks, delay_s
        self.props = copy.deepcopy(recorded("props_stock"))
        self.props["model_path"] = model_path
        self.props["total_slots"] = slots
        self.props["default_generation_settings"]["n_ctx"] = n_ctx
        slot = copy.deepcopy(recorded("slots")[0])
        self.slots = [{**slot, "id": i, "is_processing": False} for i in range(slots)]
        self.served = 0
        self._server: TestServer | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post(PATH, self._chat)
        app.router.add_get("/props", lambda _: self._json(self.props))
        app.router.add_get("/slots", lambda _: self._json(self.slots))
        app.router.add_get("/health", lambda _: self._json(recorded("health")))
        app.router.add_get("/v1/models", lambda _: self._json({"object": "list", "data": [{"id": "fake"}]}))
        app.router.add_post("/tokenize", self._tokenize)
        return app

    async def start(self, port: int | None = None) -> str:
        self._server = TestServer(self.app(), host="127.0.0.1", port=port or free_port())
        await self._server.start_server()
        return f"http://127.0.0.1:{self._server.port}"

    async def close(self) -> None:
        if self._server is not None:
            await self._server.close()

    @staticmethod
    async def _json(value: Any) -> web.Response:
        return web.json_response(value)

    async def _tokenize(self, request: web.Request) -> web.Response:
        text = str((await request.json()).get("content", ""))
        return web.json_response({"tokens": [hash(w) % 150_000 for w in text.split()]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        n = int(body.get("max_tokens") or self.chunks)
        pace = float(body["pace_ms"]) / 1000 if body.get("pace_ms") else self.delay_s
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(ROLE)
        sent = CHUNKS[bool(body.get("timings_per_token"))]
        for i in range(n):
            await resp.write(sent[i % MAX_CHUNKS])
            if pace:
                await asyncio.sleep(pace)
        final = {"choices": [{"finish_reason": "length", "index": 0, "delta": {}}], **HEAD, "timings": timings(n)}
        await resp.write(_event(final) + b"data: [DONE]\n\n")
        await resp.write_eof()
        self.served += 1
        return resp


def run(port: int, chunks: int, model_path: str = "/nonexistent/fake.gguf") -> None:
    """Serve on `port` until killed: the target of a process of its own."""
    upstream = FastUpstream(chunks=chunks, model_path=model_path)
    web.run_app(upstream.app(), host="127.0.0.1", port=port, print=None, access_log=None)
