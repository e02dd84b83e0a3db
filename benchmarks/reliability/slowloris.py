"""Slow clients: can a local process that opens many connections and sends their headers a byte at a
time (slowloris) hold the proxy's connections and file descriptors, and what does that do to an ordinary request?

Run:  .venv/bin/python -m benchmarks.reliability.slowloris --label after [--src DIR] [--sockets 2000] [--trickle-s 5]
      [--requests 50] [--nofile 1024] [--settle-s 12] [--serve-arg=--header-timeout=10 ...]
      [--out benchmarks/results/slowloris.json]
      # the code before a change: its src/ (git archive HEAD src | tar -x -C /tmp/before), then
      .venv/bin/python -m benchmarks.reliability.slowloris --label before --src /tmp/before/src

One real llama-server (the tests' tiny random llama, `-t 1`, one slot) and `adaptive-spec serve --profile` attached to
it, from this checkout or from `--src` (put first on its PYTHONPATH). The attack is on the proxy's side, so the
upstream only has to answer the ordinary requests; a real one is cheap here, so no fake is needed. The proxy starts
with its soft RLIMIT_NOFILE at `--nofile` (default 1024, a Linux desktop's default; the hard limit is left as it is),
as it would from a terminal.

An ordinary request is a one-token greedy chat completion on a fresh connection (http.client, 5 s timeout), the way a
new agent process or a reconnecting one reaches the proxy; `--requests` of them, 0.2 s apart, first with nothing else
running (quiet), then during the flood. The flood is a separate process keeping `--sockets` connections open, each
sending a request line and Host, then one byte of a never-ending header every `--trickle-s` seconds, and opening a new
connection whenever the proxy closes one (as a real slowloris does). The ordinary requests start `--settle-s` after
the flood has opened its sockets, so that they meet the proxy after its header bound (if any) has begun closing them.
Every second, from /proc: the proxy's open descriptors, the client connections it holds (ESTABLISHED sockets on its
port among its descriptors), its RSS; from the flood: how many of its sockets are open and how many the proxy closed.
Figures: ordinary requests answered, their latency p50/p95 (answered ones), the most descriptors and connections held
during the flood, and the proxy's log lines about running out of descriptors. Runs are kept in `--out` by label, so
one file holds the code before and after a change side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import multiprocessing
import os
import random
import resource
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

from tests.support.models.tiny_gguf import write_tiny_gguf
from tests.support.processes.servers import LlamaServer, ProxyProcess

from benchmarks.harness import ROOT, results
from benchmarks.harness.stats import percentile

NAME = "benchmarks.reliability.slowloris"  # the result file's `benchmark`
_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
_TRICKLE = b"X-Slow: " + b"a" * 64  # a header line that never ends, one byte at a time
_CHAT = json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
).encode()


# --- the flood, in its own process -----------------------------------------------------------------------------------


def _flood_main(port: int, sockets: int, trickle_s: float, stop: Event, report: Connection) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, sockets + 256)), hard))
    asyncio.run(_flood(port, sockets, trickle_s, stop, report))


async def _flood(port: int, sockets: int, trickle_s: float, stop: Event, report: Connection) -> None:
    stats = {"open": 0, "opened": 0, "closed_by_proxy": 0, "connect_failed": 0}
    tasks = []
    for i in range(sockets):
        tasks.append(asyncio.create_task(_slow_client(port, trickle_s, stats)))
        if i % 100 == 99:
            await asyncio.sleep(0.05)
    while not stop.is_set():
        report.send(dict(stats))
        await asyncio.sleep(0.5)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    report.send(dict(stats))


async def _slow_client(port: int, trickle_s: float, stats: dict[str, int]) -> None:
    while True:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
        except (OSError, TimeoutError):
            stats["connect_failed"] += 1
            await asyncio.sleep(0.5)
            continue
        stats["open"] += 1
        stats["opened"] += 1
        try:
            writer.write(_HEAD)
            wait = random.uniform(0.1, trickle_s)  # spread the trickles over the interval
            for i in range(1 << 30):
                try:
                    await asyncio.wait_for(reader.read(4096), wait)
                    break  # an answer or the end: the proxy is done with this connection
                except TimeoutError:
                    writer.write(_TRICKLE[i % len(_TRICKLE) : i % len(_TRICKLE) + 1])
                    await writer.drain()
                    wait = trickle_s
        except OSError:
            pass  # reset by the proxy
        finally:
            stats["open"] -= 1
            writer.close()
        stats["closed_by_proxy"] += 1


# --- what the proxy holds, from /proc --------------------------------------------------------------------------------


def _socket_inodes(pid: int) -> tuple[int, set[str]]:
    """The process's open descriptors, and the inodes of its sockets."""
    inodes = set()
    fds = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        fds += 1
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return fds, inodes


def _held(port: int, inodes: set[str]) -> int:
    """ESTABLISHED TCP connections on the proxy's port that are the proxy's descriptors (accepted ones)."""
    held = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "01" and int(fields[1].rsplit(":", 1)[1], 16) == port and fields[9] in inodes:
                held += 1
    return held


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class _Sampler(threading.Thread):
    def __init__(self, pid: int, port: int, flood: Connection | None) -> None:
        super().__init__(daemon=True)
        self.pid, self.port, self.flood = pid, port, flood
        self.samples: list[dict[str, Any]] = []
        self.flood_stats: dict[str, int] = {}
        self.done = threading.Event()

    def run(self) -> None:
        started = time.monotonic()
        while not self.done.wait(1.0):
            while self.flood is not None and self.flood.poll():
                self.flood_stats = self.flood.recv()
            fds, inodes = _socket_inodes(self.pid)
            self.samples.append(
                {
                    "t_s": round(time.monotonic() - started, 1),
                    "fds": fds,
                    "held": _held(self.port, inodes),
                    "rss_mib": round(_rss_mib(self.pid), 1),
                    "flood_open": self.flood_stats.get("open", 0),
                    "flood_closed_by_proxy": self.flood_stats.get("closed_by_proxy", 0),
                }
            )


# --- ordinary requests -----------------------------------------------------------------------------------------------


def _ordinary(port: int, count: int) -> dict[str, Any]:
    latencies_ms: list[float] = []
    failures: dict[str, int] = {}
    for _ in range(count):
        started = time.perf_counter()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("POST", "/v1/chat/completions", _CHAT, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            resp.read()
            conn.close()
            if resp.status == 200:
                latencies_ms.append((time.perf_counter() - started) * 1000)
            else:
                failures[f"HTTP {resp.status}"] = failures.get(f"HTTP {resp.status}", 0) + 1
        except (OSError, http.client.HTTPException) as exc:
            failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
        time.sleep(0.2)
    return {
        "requests": count,
        "answered": len(latencies_ms),
        "failures": failures,
        "p50_ms": _pct(latencies_ms, 0.5),
        "p95_ms": _pct(latencies_ms, 0.95),
        "max_ms": max(latencies_ms) if latencies_ms else None,
    }


def _pct(values: list[float], q: float) -> float | None:
    value = percentile(values, q)
    return None if value is None else round(value, 1)


# --- one run ---------------------------------------------------------------------------------------------------------


def _start_proxy(args: argparse.Namespace, upstream: str) -> ProxyProcess:
    env = {"PYTHONPATH": str(Path(args.src).resolve())} if args.src else None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(args.nofile, hard), hard))  # the proxy inherits it
    try:
        return ProxyProcess("--profile", f"plain={upstream}", *args.serve_arg, env=env)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _run(args: argparse.Namespace, proxy: ProxyProcess) -> dict[str, Any]:
    pid = proxy.proc.pid
    quiet_sampler = _Sampler(pid, proxy.port, None)
    quiet_sampler.start()
    quiet = _ordinary(proxy.port, args.requests)
    quiet_sampler.done.set()
    print(f"quiet: {quiet}", flush=True)
    stop = multiprocessing.get_context("spawn").Event()
    ours, theirs = multiprocessing.get_context("spawn").Pipe(duplex=False)
    flood = multiprocessing.get_context("spawn").Process(
        target=_flood_main, args=(proxy.port, args.sockets, args.trickle_s, stop, theirs), daemon=True
    )
    flood.start()
    sampler = _Sampler(pid, proxy.port, ours)
    sampler.start()
    try:
        ramp_until = time.monotonic() + 30
        while time.monotonic() < ramp_until and sampler.flood_stats.get("opened", 0) < args.sockets:
            time.sleep(0.5)
        time.sleep(args.settle_s)
        print(f"flood: {sampler.flood_stats}; proxy holds {sampler.samples[-1] if sampler.samples else '?'}")
        during = _ordinary(proxy.port, args.requests)
        print(f"during the flood: {during}", flush=True)
    finally:
        stop.set()
        flood.join(30)
        sampler.done.set()
        sampler.join(5)
    samples = sampler.samples
    out_of_fds = [
        line for line in proxy.log().splitlines() if "Too many open files" in line or "out of system resource" in line
    ]
    return {
        "quiet": quiet,
        "flood": during,
        "quiet_fds": max((s["fds"] for s in quiet_sampler.samples), default=None),
        "quiet_held": max((s["held"] for s in quiet_sampler.samples), default=None),
        "flood_max_fds": max((s["fds"] for s in samples), default=None),
        "flood_max_held": max((s["held"] for s in samples), default=None),
        "flood_mean_held": round(statistics.fmean(s["held"] for s in samples), 1) if samples else None,
        "flood_max_rss_mib": max((s["rss_mib"] for s in samples), default=None),
        "flood_stats": sampler.flood_stats,
        "out_of_fds_log_lines": len(out_of_fds),
        "out_of_fds_first": out_of_fds[:2],
        "samples": samples,
    }


def _print(runs: dict[str, dict[str, Any]]) -> None:
    head = (
        f"{'run':<38} {'quiet p50/p95 ms':>17} {'flood answered':>14} {'flood p50/p95 ms':>17} "
        f"{'max held':>8} {'max fds':>7} {'closed by proxy':>15} {'EMFILE lines':>12}"
    )
    print(head)

    def ms(part: dict[str, Any]) -> str:
        p50, p95 = part["p50_ms"], part["p95_ms"]
        return "-" if p50 is None else f"{p50:.0f}/{p95:.0f}"

    for label, run in runs.items():
        r = run["result"]
        print(
            f"{label:<38} {ms(r['quiet']):>17} {r['flood']['answered']:>6}/{r['flood']['requests']:<7} "
            f"{ms(r['flood']):>17} {r['flood_max_held']!s:>8} {r['flood_max_fds']!s:>7} "
            f"{r['flood_stats'].get('closed_by_proxy', 0):>15} {r['out_of_fds_log_lines']:>12}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--label", required=True, help="the run's name in --out (e.g. before, after)")
    parser.add_argument("--src", help="serve this src/ instead of the checkout's (put first on PYTHONPATH)")
    parser.add_argument("--sockets", type=int, default=2000, help="slow connections the flood keeps open")
    parser.add_argument("--trickle-s", type=float, default=5.0, help="seconds between a slow header's bytes")
    parser.add_argument("--requests", type=int, default=50, help="ordinary requests, quiet and during the flood")
    parser.add_argument("--nofile", type=int, default=1024, help="the proxy's soft RLIMIT_NOFILE at start")
    parser.add_argument("--settle-s", type=float, default=12.0, help="flood time before the ordinary requests")
    parser.add_argument("--serve-arg", action="append", default=[], help="more `serve` arguments (repeatable)")
    parser.add_argument("--llama-server", help="llama-server binary (default: the one serve would use)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "slowloris.json")
    args = parser.parse_args(argv)
    from adaptive_spec.bench import machine
    from adaptive_spec.llama.binary.which import find_llama_server

    work = Path(tempfile.mkdtemp(prefix="slowloris-"))
    model = write_tiny_gguf(work / "tiny-random-llama.gguf")
    server = LlamaServer(find_llama_server(args.llama_server), model, "-c", "2048", "--parallel", "1", log_dir=work)
    load_start = machine.sample()
    try:
        proxy = _start_proxy(args, server.url)
        try:
            result = _run(args, proxy)
        finally:
            proxy.stop()
    finally:
        server.stop()
    load_end = machine.sample()
    runs: dict[str, dict[str, Any]] = {}
    if args.out.exists():
        runs = results.read(args.out).get("runs", {})
    runs[args.label] = {
        "setup": {
            "src": args.src or "this checkout",
            "sockets": args.sockets,
            "trickle_s": args.trickle_s,
            "nofile_soft": args.nofile,
            "settle_s": args.settle_s,
            "serve_args": args.serve_arg,
            "cores": os.cpu_count(),
            "load_start": asdict(load_start),
            "load_end": asdict(load_end),
            "load_warning": machine.judge(load_start, load_end),
            "command": " ".join([sys.executable, *sys.argv]),
        },
        "result": result,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results.write(args.out, NAME, {"note": (__doc__ or "").split("\n\n")[0], "runs": runs})
    _print(runs)
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
