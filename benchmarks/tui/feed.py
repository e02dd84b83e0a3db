"""How much CPU the TUI takes to keep up with a busy proxy.

Writes a synthetic feed (N concurrent streams, each announcing draft progress several times a second, then finishing
with a record; sessions that iterate and accept more drafts as they go), serves it as a real SSE endpoint on
loopback at a fixed rate, points the real app at it headless, and reports the app's CPU share (process time over
wall time), frames drawn and events folded. Prints the figures and writes them to --out (JSON).

    python -m benchmarks.tui.feed --streams 32 --rate 300 --seconds 20
    python -m benchmarks.tui.feed --write-feed feed.jsonl   # only write the synthetic feed (for --replay)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import resource
import sys
import time
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from adaptive_spec.llama.launch import free_port
from adaptive_spec.tui.app import make_app
from benchmarks.harness import ROOT, results

NAME = "benchmarks.tui.feed"  # the result file's `benchmark`


def synthetic_feed(streams: int, seconds: float, rate: float, seed: int = 7) -> list[dict[str, Any]]:
    """About `rate` events a second over `seconds`, from `streams` concurrent requests on two profiles."""
    rng = random.Random(seed)
    t0 = time.time()
    profiles = [
        {
            "name": "oneshot",
            "base_url": "http://127.0.0.1:1",
            "up": True,
            "spec_types": ["none"],
            "slots": 4,
            "model": "demo.gguf",
            "default": True,
        },
        {
            "name": "iterative",
            "base_url": "http://127.0.0.1:2",
            "up": True,
            "spec_types": ["ngram-mod"],
            "slots": 4,
            "model": "demo.gguf",
            "default": False,
        },
    ]
    events: list[dict[str, Any]] = [{"type": "snapshot", "profiles": profiles, "sessions": [], "at_unix": t0}]
    per_stream = rate / streams  # progress events a second per stream
    n = 0
    for s in range(streams):
        at = t0 + rng.random()
        turn = 0
        while at < t0 + seconds:
            turn += 1
            n += 1
            rid, sid = f"req-{n}", f"ses-{s:03d}"
            profile = "iterative" if turn > 1 else "oneshot"
            share = min(0.95, 0.2 * turn) if profile == "iterative" else 0.0
            events.append(
                {
                    "type": "RequestStarted",
                    "request_id": rid,
                    "api": "chat",
                    "project": f"proj{s % 3}",
                    "profile": profile,
                    "session_id": sid,
                    "session_source": "header:x-session-id",
                    "stream": True,
                    "route": "estimate",
                    "reason": f"{profile}: copyable {share:.0%}",
                    "moved_from": None,
                    "at_unix": at,
                }
            )
            out = drafted = accepted = 0
            for _ in range(rng.randint(8, 24)):
                at += 1 / per_stream
                step = rng.randint(4, 12)
                out += step
                acc = int(step * share)
                accepted += acc
                drafted += acc + (1 if share else 0)
                events.append(
                    {
                        "type": "DraftProgress",
                        "request_id": rid,
                        "profile": profile,
                        "predicted_n": out,
                        "draft_n": drafted,
                        "draft_n_accepted": accepted,
                        "predicted_per_second": 40.0,
                        "at_unix": at,
                    }
                )
            record = {
                "request_id": rid,
                "started_at_unix": at - 2,
                "method": "POST",
                "path": "/v1/chat/completions",
                "api": "chat",
                "project": f"proj{s % 3}",
                "session_id": sid,
                "session_source": "header:x-session-id",
                "subagent": False,
                "profile": profile,
                "stream": True,
                "status": 200,
                "outcome": "finished",
                "error": None,
                "ttft_ms": 90.0,
                "ttst_ms": 120.0,
                "total_ms": 2000.0,
                "route": "estimate",
                "reason": f"{profile}: copyable {share:.0%}",
                "moved_from": "oneshot" if turn == 2 else None,
                "handoff": None,
                "timings": {
                    "prompt_n": 40,
                    "cache_n": 900 * turn,
                    "predicted_n": out,
                    "predicted_ms": out * 20.0,
                    "predicted_per_second": 50.0,
                    "draft_n": drafted,
                    "draft_n_accepted": accepted,
                },
            }
            events.append({"type": "RequestFinished", "record": record, "at_unix": at})
            at += rng.random()
    events[1:] = sorted(events[1:], key=lambda e: e["at_unix"])
    return events


async def serve_feed(events: list[dict[str, Any]], port: int) -> None:
    """The feed as a proxy would send it, on its recorded clock; runs in its own process so that the app's CPU
    figures are the app's alone."""

    async def feed(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        start, first = time.monotonic(), events[0]["at_unix"]
        for event in events:
            delay = (event["at_unix"] - first) - (time.monotonic() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            payload = {k: v for k, v in event.items() if k != "type"}
            await resp.write(b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n")
        await asyncio.sleep(3600)
        return resp

    async def requests(_request: web.Request) -> web.Response:
        return web.json_response({"total": 0, "requests": []})

    async def route(_request: web.Request) -> web.Response:
        return web.json_response({"policy": {"sources": []}, "pins": {}})

    # Every route the app reads after the snapshot: one it cannot read makes it reconnect, and the feed start again.
    app = web.Application()
    app.router.add_get("/adaptive/events", feed)
    app.router.add_get("/adaptive/requests", requests)
    app.router.add_get("/adaptive/route", route)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.sleep(3600)


async def measure(seconds: float, feed_file: Path) -> dict[str, Any]:
    port = free_port("127.0.0.1")
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-m", NAME, "--serve", str(feed_file), "--port", str(port), cwd=ROOT
    )
    try:
        await asyncio.sleep(1.5)
        app = make_app(url=f"http://127.0.0.1:{port}")
        async with app.run_test(size=(160, 48)) as pilot:
            while not app.connected:
                await pilot.pause(0.05)
            connected_at = app.connected_since or 0.0
            cpu0, wall0, events0, frames0 = _cpu(), time.monotonic(), app.events_seen, app.frames
            lags: list[float] = []
            for _ in range(int(seconds * 10)):  # responsiveness: how late a 100 ms timer fires while the feed runs
                before = time.monotonic()
                await asyncio.sleep(0.1)
                lags.append((time.monotonic() - before - 0.1) * 1000)
            cpu_s, wall_s = _cpu() - cpu0, time.monotonic() - wall0
            folded, frames = app.events_seen - events0, app.frames - frames0
            if not app.connected or app.connected_since is None or app.connected_since > connected_at:
                raise RuntimeError("the app lost the feed during the run: its figures would be of reconnects")
            frame_ms = sorted(app.frame_ms)
    finally:
        server.terminate()
        await server.wait()
    lags.sort()
    return {
        "events_per_s_fed": round(folded / wall_s, 1),
        "seconds": round(wall_s, 1),
        "frames_per_s": round(frames / wall_s, 2),
        "cpu_share_of_one_core": round(cpu_s / wall_s, 3),
        "redraw_ms_p50": round(frame_ms[len(frame_ms) // 2], 1) if frame_ms else None,
        "redraw_ms_max": round(frame_ms[-1], 1) if frame_ms else None,
        "event_loop_lag_ms_p50": round(lags[len(lags) // 2], 1),
        "event_loop_lag_ms_p99": round(lags[min(len(lags) - 1, int(len(lags) * 0.99))], 1),
    }


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--rate", type=float, default=300.0, help="feed events a second")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/tui_feed.json"))
    parser.add_argument("--write-feed", type=Path, help="only write the synthetic feed as a --replay file")
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)  # the feed server's own process
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        events = [orjson.loads(line) for line in args.serve.read_bytes().splitlines()]
        asyncio.run(serve_feed(events, args.port))
        return
    if args.write_feed:
        events = synthetic_feed(args.streams, args.seconds, args.rate)
        args.write_feed.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in events))
        print(f"wrote {len(events)} events to {args.write_feed}")
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    feed_file = args.out.with_suffix(".feed.jsonl")
    events = synthetic_feed(args.streams, args.seconds, args.rate)
    feed_file.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in events))
    result = {"streams": args.streams, **asyncio.run(measure(args.seconds, feed_file))}
    print(json.dumps(result, indent=2))
    results.write(args.out, NAME, result)


if __name__ == "__main__":
    main()
