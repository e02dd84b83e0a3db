"""Load: many concurrent streaming clients against `adaptive-spec serve` (its own process, loopback only), for a fixed
time. Prints and writes the figures: answers by how they ended, requests per second, the proxy's resident memory and
open descriptors at start, middle and end, its request history and session tables against their bounds, and (with
--trace) whether every request was recorded exactly once.

  fake: in front of a fast fake llama-server (this process), so the figures are the proxy's own.
  real: in front of two launched profiles (tiny random-weight model, -t 1, --parallel N): more clients than slots, so
        requests queue inside llama-server; none may be lost or hang.

Run (from the repository root):
  python -m tests.stress.load fake --clients 64 --seconds 60 --out load-fake.json
  python -m tests.stress.load real --clients 16 --seconds 60 --parallel 4 --out load-real.json
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from tests.stress.rig import StreamResult, median, process_figures, write_figures
from tests.support.fakes.fast_upstream import FastUpstream, answer_text
from tests.support.models.tiny_gguf import write_tiny_gguf
from tests.support.processes.servers import ProxyProcess, http_json

MAX_SESSIONS = 64
HISTORY = 1000
SESSIONS_PER_CLIENT = 8  # each client cycles through this many sessions: more sessions than the table keeps
REQUEST_TIMEOUT_S = 120.0


@dataclass
class LoadRun:
    mode: str
    clients: int
    seconds: float
    results: list[StreamResult] = field(default_factory=list)
    samples: dict[str, dict[str, Any]] = field(default_factory=dict)
    expected_text: str | None = None

    def figures(self, proxy: ProxyProcess, trace: Path | None) -> dict[str, Any]:
        ended = Counter(r.ended for r in self.results)
        wrong_text = sum(1 for r in self.results if r.ended == "done" and self.expected_text not in (None, r.text))
        out: dict[str, Any] = {
            "mode": self.mode,
            "clients": self.clients,
            "seconds": self.seconds,
            "requests": len(self.results),
            "requests_per_s": round(len(self.results) / self.seconds, 1),
            "ended": dict(ended),
            "errors": len(self.results) - ended["done"],
            "wrong_text": wrong_text,
            "latency_s_median": median([r.seconds for r in self.results]),
            "latency_s_max": max((r.seconds for r in self.results), default=0.0),
            "proxy_process": self.samples,
        }
        out["tables"] = _tables(proxy)
        ids = [r.request_id for r in self.results if r.request_id]
        out["request_ids_unique"] = len(set(ids)) == len(ids) == len(self.results)
        out["history_total"] = out["tables"]["history_total"]
        if trace is not None:
            out["trace"] = trace_check(trace, ids)
        return out


def _tables(proxy: ProxyProcess) -> dict[str, Any]:
    requests = http_json(proxy.base + "/adaptive/requests")
    sessions = http_json(proxy.base + "/adaptive/sessions")
    route = http_json(proxy.base + "/adaptive/route")
    return {
        "history_kept": len(requests["requests"]),
        "history_bound": HISTORY,
        # The clients' requests: the proxy's own (its speed measurement at start, a probe) are records too.
        "history_total": requests["total"] - requests.get("own_total", 0),
        "sessions_kept": len(sessions.get("sessions", [])),
        "sessions_bound": MAX_SESSIONS,
        "session_updates_dropped": sessions.get("updates_dropped"),
        "router_in_flight_after": route["in_flight"],
    }


def trace_check(trace: Path, ids: list[str]) -> dict[str, Any]:
    """Whether each request id the clients got is in the trace (and its rotations) exactly once."""
    paths = sorted(trace.parent.glob(trace.name + "*"))
    lines = [orjson.loads(line) for path in paths for line in path.read_text().splitlines() if line.strip()]
    traced = Counter(str(line["request_id"]) for line in lines if line.get("kind") == "request")
    sent = set(ids)  # made once: an hour's soak checks ~260,000 ids (built per id it took longer than the soak)
    return {
        "request_lines": sum(traced.values()),
        "recorded_exactly_once": all(traced[i] == 1 for i in ids),
        "missing": sum(1 for i in ids if traced[i] == 0),
        "duplicated": sum(1 for i in ids if traced[i] > 1),
        "not_sent_by_a_client": sum(1 for i in traced if i not in sent),
    }


async def _client(
    n: int, session: aiohttp.ClientSession, url: str, body: dict[str, Any], deadline: float, run: LoadRun
) -> None:
    from tests.stress.rig import stream_chat

    turn = 0
    while time.monotonic() < deadline:
        headers = {"x-session-id": f"load-{n}-{turn % SESSIONS_PER_CLIENT}"}
        turn += 1
        run.results.append(await stream_chat(session, url, body, headers, REQUEST_TIMEOUT_S))


async def drive(proxy: ProxyProcess, run: LoadRun, body: dict[str, Any]) -> None:
    """`run.clients` clients, each sending one streamed request after another until the time is up; the proxy's
    process figures sampled at the start, the middle and the end."""
    url = proxy.base + "/v1/chat/completions"
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        deadline = time.monotonic() + run.seconds
        clients = [asyncio.create_task(_client(n, session, url, body, deadline, run)) for n in range(run.clients)]
        await asyncio.sleep(min(2.0, run.seconds / 4))
        run.samples["start"] = process_figures(proxy.proc.pid)
        await asyncio.sleep(max(0.0, deadline - time.monotonic() - run.seconds / 2))
        run.samples["middle"] = process_figures(proxy.proc.pid)
        await asyncio.gather(*clients)
        run.samples["end"] = process_figures(proxy.proc.pid)
    await asyncio.sleep(6)  # idle pooled connections are closed by a sweep every 2 s: gone within 4 s
    run.samples["idle_after"] = process_figures(proxy.proc.pid)


def _serve_args(trace: Path | None) -> list[str]:
    args = ["--history", str(HISTORY), "--max-sessions", str(MAX_SESSIONS)]
    return args + (["--trace", str(trace)] if trace is not None else [])


async def run_fake(clients: int, seconds: float, trace: Path | None = None) -> dict[str, Any]:
    upstream = FastUpstream(chunks=16, delay_s=0.002)
    url = await upstream.start()
    proxy = await asyncio.to_thread(
        ProxyProcess, "--profile", f"fake={url}", "--tokenizer", "endpoint", *_serve_args(trace)
    )
    try:
        run = LoadRun("fake", clients, seconds, expected_text=answer_text(16))
        body = {"model": "m", "messages": [{"role": "user", "content": "Say something."}]}
        await drive(proxy, run, body)
        figures = await asyncio.to_thread(run.figures, proxy, trace)
        figures["upstream_served"] = upstream.served
        return figures
    finally:
        await asyncio.to_thread(proxy.stop)
        await upstream.close()


async def run_real(clients: int, seconds: float, parallel: int, workdir: Path, max_tokens: int) -> dict[str, Any]:
    model = write_tiny_gguf(workdir / "tiny-random-llama.gguf")
    trace = workdir / "trace.jsonl"
    proxy = await asyncio.to_thread(
        ProxyProcess,
        "--model",
        str(model),
        "--threads",
        "1",
        "--ctx-size",
        str(2048 * parallel),
        "--parallel",
        str(parallel),
        *_serve_args(trace),
        env={"ADAPTIVE_SPEC_STATE_DIR": str(workdir / "state"), "ADAPTIVE_SPEC_CONFIG_DIR": str(workdir / "config")},
    )
    try:
        run = LoadRun("real", clients, seconds)
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "Say something."}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        await drive(proxy, run, body)
        figures = await asyncio.to_thread(run.figures, proxy, trace)
        figures["parallel"] = parallel
        figures["served_by"] = dict(Counter(r["profile"] for r in proxy.requests()))
        return figures
    finally:
        await asyncio.to_thread(proxy.stop)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["fake", "real"])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--parallel", type=int, default=4, help="slots per launched profile (real)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (real)")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.mode == "fake":
            figures = asyncio.run(run_fake(args.clients, args.seconds, Path(tmp) / "trace.jsonl"))
        else:
            figures = asyncio.run(run_real(args.clients, args.seconds, args.parallel, Path(tmp), args.max_tokens))
    write_figures(figures, args.out)
    ok = figures["errors"] == 0 and figures["wrong_text"] == 0 and figures.get("trace", {}).get("missing", 0) == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
