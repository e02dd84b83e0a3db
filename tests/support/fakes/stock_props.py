"""A stand-in for a stock llama-server, made of the patched one: a pass-through that answers as the server behind it
does, except that `/props` loses `speculative_per_request` (how a stock build looks to the proxy's probe). Every
other byte, per-request speculation included, passes as it came, so only the probe is fooled.

    stock_props.py serve PORT UPSTREAM_URL    the pass-through alone, in front of a running server
    stock_props.py wrap BINARY ARGS...        a `--llama-server` for `serve`: starts BINARY ARGS on another port and
                                              answers on the `--port` of ARGS (stops BINARY when it is stopped)

Standalone on purpose (aiohttp, the standard library and the installed adaptive_spec only, not the tests package):
`serve` starts it by path as its llama-server.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys

import aiohttp
from aiohttp import web

from adaptive_spec.llama.launch import free_port

_HOP = {"content-length", "transfer-encoding", "connection", "content-encoding"}


def _app(upstream: str) -> web.Application:
    async def start(app: web.Application) -> None:
        app["client"] = aiohttp.ClientSession(auto_decompress=False)

    async def stop(app: web.Application) -> None:
        await app["client"].close()

    async def handle(request: web.Request) -> web.StreamResponse:
        client: aiohttp.ClientSession = request.app["client"]
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP | {"host"}}
        try:
            async with client.request(
                request.method, upstream + request.rel_url.path_qs, data=await request.read(), headers=headers
            ) as resp:
                body = await resp.read()
                if request.path == "/props" and resp.status == 200:
                    props = json.loads(body)
                    props.pop("speculative_per_request", None)
                    body = json.dumps(props).encode()
                out = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP}
                return web.Response(status=resp.status, body=body, headers=out)
        except aiohttp.ClientError as exc:
            return web.Response(status=503, text=f"upstream not ready: {exc}")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


async def _serve(port: int, upstream: str, child: subprocess.Popen[bytes] | None = None) -> None:
    runner = web.AppRunner(_app(upstream), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    while not done.is_set() and (child is None or child.poll() is None):
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), 0.2)
    await runner.cleanup()


def _die_with_parent() -> None:
    """The server ends with this pass-through, even if it is killed (as the launcher's own children do)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def main(argv: list[str]) -> int:
    if argv[0] == "serve":
        asyncio.run(_serve(int(argv[1]), argv[2].rstrip("/")))
        return 0
    binary, args = argv[1], list(argv[2:])
    at = args.index("--port") + 1
    port, inner = int(args[at]), free_port("127.0.0.1")
    args[at] = str(inner)
    child = subprocess.Popen([binary, *args], preexec_fn=_die_with_parent)
    try:
        asyncio.run(_serve(port, f"http://127.0.0.1:{inner}", child))
    finally:
        child.terminate()
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
    if child.returncode < 0:  # died of a signal: so does this wrapper, so its launcher sees the same death
        signal.signal(-child.returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -child.returncode)
    return child.returncode or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
