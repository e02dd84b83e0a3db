"""KV handoffs that fail half way, against real llama-servers: two attached profiles share a slot directory, and a
pass-through in front of one of them injects the fault:

  cut-after-save       the slot file is cut to half its size once the old profile has saved it (a full disk): the
                       new profile must not restore it (llama-server aborts on a short slot file)
  restore-answer-lost  the new profile restores the slot, but its answer is lost on the way back

Either way the moved request must answer, with the text a fresh server gives for the same conversation."""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from tests.support.models.tiny_gguf import write_tiny_gguf
from tests.support.processes.servers import LlamaServer, ProxyProcess, free_port, http_json

PASTED = "Here is a.py:\n```python\n" + "\n".join(f"value_{i} = {i} * {i}" for i in range(60)) + "\n```\nWhat is it?"


class SlotFault:
    """Forwards everything to `target`, injecting `mode` into its slot actions."""

    def __init__(self, target: str, slot_dir: Path, mode: str) -> None:
        self.target, self.slot_dir, self.mode = target, slot_dir, mode
        self.injected: list[str] = []
        self.server: TestServer | None = None

    async def start(self) -> str:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self.server = TestServer(app, host="127.0.0.1", port=free_port())
        await self.server.start_server()
        return str(self.server.make_url("")).rstrip("/")

    async def _forward(self, request: web.Request) -> web.Response:
        body = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with (
            aiohttp.ClientSession() as session,
            session.request(request.method, self.target + request.path_qs, data=body, headers=headers) as resp,
        ):
            data = await resp.read()
        action = request.query.get("action")
        if action == "save" and self.mode == "cut-after-save":
            path = self.slot_dir / json.loads(body)["filename"]
            size = path.stat().st_size
            os.truncate(path, size // 2)
            self.injected.append(f"cut {path.name} from {size} to {size // 2} bytes; save answered {data[:200]!r}")
        if action == "restore" and self.mode == "restore-answer-lost":
            self.injected.append(f"dropped the restore's answer {data[:200]!r}")
            assert request.transport is not None
            request.transport.close()
        return web.Response(status=resp.status, body=data, content_type=resp.content_type)

    async def close(self) -> None:
        if self.server is not None:
            await self.server.close()


def _chat(base: str, messages: list[dict[str, str]], headers: dict[str, str]) -> tuple[str, str | None]:
    body = {"model": "m", "messages": messages, "temperature": 0, "seed": 1, "max_tokens": 24}
    req = urllib.request.Request(
        base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        reply = json.loads(resp.read())
        return str(reply["choices"][0]["message"]["content"]), resp.headers.get("x-adaptive-spec-request-id")


async def run_slot_fault(workdir: Path, mode: str) -> dict[str, Any]:
    from adaptive_spec.llama.binary.which import find_llama_server

    binary, model = find_llama_server(None), write_tiny_gguf(workdir / "tiny-random-llama.gguf")
    slots = workdir / "slots"
    slots.mkdir()
    args = ("-c", "8192", "--parallel", "1", "--spec-type", "none", "--slot-save-path", str(slots))
    servers = [await asyncio.to_thread(LlamaServer, binary, model, *args, log_dir=workdir / "logs") for _ in range(3)]
    source, target, fresh = servers
    fault = SlotFault(source.url if mode == "cut-after-save" else target.url, slots, mode)
    front = await fault.start()
    urls = (front, target.url) if mode == "cut-after-save" else (source.url, front)
    proxy = await asyncio.to_thread(
        ProxyProcess, "--profile", f"a={urls[0]}", "--profile", f"b={urls[1]}", "--slot-dir", str(slots)
    )
    try:
        figures = await asyncio.to_thread(_scenario, proxy, fresh, fault)
        figures["target_alive"] = target._server.process is not None and target._server.process.returncode is None
        return figures
    finally:
        await asyncio.to_thread(proxy.stop)
        await fault.close()
        for server in servers:
            await asyncio.to_thread(server.stop)


def _scenario(proxy: ProxyProcess, fresh: LlamaServer, fault: SlotFault) -> dict[str, Any]:
    history = [{"role": "user", "content": PASTED}]
    first, _ = _chat(proxy.base, history, {"x-session-id": "mover", "x-adaptive-spec-profile": "a"})
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": "And now?"}]
    moved, request_id = _chat(proxy.base, history, {"x-session-id": "mover", "x-adaptive-spec-profile": "b"})
    expected, _ = _chat(fresh.url, history, {})
    record = next(r for r in proxy.requests() if r["request_id"] == request_id)
    again, _ = _chat(proxy.base, history, {"x-session-id": "mover", "x-adaptive-spec-profile": "b"})
    return {
        "mode": fault.mode,
        "injected": fault.injected,
        "status": record["status"],
        "moved_from": record["moved_from"],
        "handoff": record["handoff"],
        "cache_n": (record.get("timings") or {}).get("cache_n"),
        "text_equals_fresh_server": moved == expected,
        "next_turn_equals_fresh_server": again == expected,
        "texts": {"moved": moved, "fresh": expected},
        "handoffs": http_json(proxy.base + "/adaptive/route")["handoffs"],
    }
