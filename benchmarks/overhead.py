"""Proxy overhead: the same fast upstream streamed directly and through adaptive-spec, side by side.

Run:  .venv/bin/python benchmarks/overhead.py [--chunks 200] [--out benchmarks/results/overhead.json]

The upstream and the proxy each run in their own process, the client in this one. Figures are medians and
percentiles over interleaved rounds (direct, proxied, direct, ...), so machine noise hits both sides alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from adaptive_spec.proxy.app import ProxySettings, build_app
from adaptive_spec.proxy.upstreams import Upstream, UpstreamTable

CHUNK = orjson.dumps(
    {"choices": [{"index": 0, "delta": {"content": " token"}}], "object": "chat.completion.chunk", "id": "x" * 32}
)


def _upstream_main(port: int, chunks: int) -> None:
    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(chunks):
            await resp.write(b"data: " + CHUNK + b"\n\n")
        final = {"choices": [], "timings": {"prompt_n": 10, "predicted_n": chunks, "predicted_per_second": 1e4}}
        await resp.write(b"data: " + orjson.dumps(final) + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handle)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def _proxy_main(port: int, upstream_port: int) -> None:
    table = UpstreamTable([Upstream("bench", f"http://127.0.0.1:{upstream_port}")])
    app = build_app(table, ProxySettings(history_size=100))
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, handler_cancellation=True)


async def _one(session: aiohttp.ClientSession, url: str) -> tuple[float, float, int]:
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
    started = time.perf_counter()
    first = 0.0
    size = 0
    async with session.post(url, data=body) as resp:
        async for chunk in resp.content.iter_any():
            if not first:
                first = time.perf_counter() - started
            size += len(chunk)
    return first, time.perf_counter() - started, size


async def _round(session: aiohttp.ClientSession, url: str, concurrency: int) -> list[tuple[float, float, int]]:
    return await asyncio.gather(*(_one(session, url) for _ in range(concurrency)))


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _measure(direct: str, proxied: str, concurrency: int, rounds: int, chunks: int) -> dict[str, Any]:
    results: dict[str, list[tuple[float, float, int]]] = {"direct": [], "proxied": []}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for url in (direct, proxied):  # warm-up
            await _round(session, url, concurrency)
        for _ in range(rounds):
            results["direct"] += await _round(session, direct, concurrency)
            results["proxied"] += await _round(session, proxied, concurrency)
    sizes = {r[2] for side in results.values() for r in side}
    assert len(sizes) == 1, f"proxied and direct bodies differ in size: {sizes}"
    ttfc = {k: [r[0] * 1000 for r in v] for k, v in results.items()}
    total = {k: [r[1] * 1000 for r in v] for k, v in results.items()}
    added_p50 = statistics.median(ttfc["proxied"]) - statistics.median(ttfc["direct"])
    added_p99 = _pct(ttfc["proxied"], 0.99) - _pct(ttfc["direct"], 0.99)
    # Each stream's extra wall time per chunk; with c streams sharing the proxy's one core this grows with c, so
    # dividing by c as well gives the proxy's own cost per relayed chunk.
    per_chunk_us = (statistics.median(total["proxied"]) - statistics.median(total["direct"])) * 1000 / chunks
    return {
        "concurrency": concurrency,
        "streams": len(results["direct"]),
        "ttfc_direct_p50_ms": statistics.median(ttfc["direct"]),
        "ttfc_proxied_p50_ms": statistics.median(ttfc["proxied"]),
        "added_ttfc_p50_ms": added_p50,
        "added_ttfc_p99_ms": added_p99,
        "total_direct_p50_ms": statistics.median(total["direct"]),
        "total_proxied_p50_ms": statistics.median(total["proxied"]),
        "per_chunk_overhead_us": per_chunk_us,
        "proxy_cost_per_chunk_us": per_chunk_us / concurrency,
    }


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _wait_port(port: int) -> None:
    for _ in range(200):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise RuntimeError(f"port {port} never opened")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chunks", type=int, default=200, help="SSE chunks per streamed response")
    parser.add_argument("--rounds", type=int, default=0, help="rounds per concurrency (default: sized per level)")
    parser.add_argument("--out", default="benchmarks/results/overhead.json")
    args = parser.parse_args()
    up_port, proxy_port = _free_port(), _free_port()
    ctx = multiprocessing.get_context("spawn")
    procs = [
        ctx.Process(target=_upstream_main, args=(up_port, args.chunks), daemon=True),
        ctx.Process(target=_proxy_main, args=(proxy_port, up_port), daemon=True),
    ]
    for proc in procs:
        proc.start()
    try:
        rows = asyncio.run(_run(up_port, proxy_port, args))
    finally:
        for proc in procs:
            proc.terminate()
            proc.join(5)
    print(
        f"\nproxy overhead, {args.chunks} SSE chunks per stream, {os.cpu_count()} cores (medians of interleaved rounds)"
    )
    print(
        "| concurrent streams | streams | added TTFC p50 (ms) | added TTFC p99 (ms) "
        "| added per chunk, per stream (µs) | proxy cost per relayed chunk (µs) |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['concurrency']} | {r['streams']} | {r['added_ttfc_p50_ms']:.3f} | {r['added_ttfc_p99_ms']:.3f} "
            f"| {r['per_chunk_overhead_us']:.1f} | {r['proxy_cost_per_chunk_us']:.1f} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"chunks": args.chunks, "rows": rows}, indent=2))
    print(f"\nwritten to {out}")
    return 0


async def _run(up_port: int, proxy_port: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    await _wait_port(up_port)
    await _wait_port(proxy_port)
    direct = f"http://127.0.0.1:{up_port}/v1/chat/completions"
    proxied = f"http://127.0.0.1:{proxy_port}/v1/chat/completions"
    rows = []
    for concurrency in (1, 8, 32):
        rounds = args.rounds or {1: 300, 8: 60, 32: 20}[concurrency]
        rows.append(await _measure(direct, proxied, concurrency, rounds, args.chunks))
    return rows


if __name__ == "__main__":
    sys.exit(main())
