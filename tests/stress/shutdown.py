"""Shutdown: SIGTERM to `adaptive-spec serve` (two launched profiles, tiny random-weight model, -t 1) while streams
are in flight, half of them short, half endless. Prints and writes the figures: how each stream ended (its whole
answer, or a final error event / error status), how long after the signal, the proxy's exit status and time, and
whether any llama-server outlived it.

Run (from the repository root):
  python -m tests.stress.shutdown --streams 16 --grace 3 --out shutdown.json
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from tests.stress.rig import StreamResult, median, stream_chat, write_figures
from tests.support.models.tiny_gguf import write_tiny_gguf
from tests.support.processes.servers import ProxyProcess, pid_alive

SHORT_TOKENS = 32
ENDLESS_TOKENS = 200_000  # far longer than any grace: only the shutdown ends it


def _llama_servers_under(state: Path) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"llama-server" in cmdline and str(state).encode() in cmdline and pid_alive(int(entry.name)):
                found.append(int(entry.name))
    return found


async def _timed(work: Any) -> tuple[StreamResult, float]:
    return await work, time.monotonic()


async def _streams(proxy: ProxyProcess, streams: int) -> tuple[list[tuple[StreamResult, float]], float, float]:
    """Start the streams, SIGTERM the proxy once they are under way; each result with when it ended, when the signal
    went, and when the proxy exited."""
    url = proxy.base + "/v1/chat/completions"
    started = [asyncio.Event() for _ in range(streams)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = []
        for n in range(streams):
            endless = n % 2 == 1
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": f"Stream {n}."}],
                "max_tokens": ENDLESS_TOKENS if endless else SHORT_TOKENS,
                "ignore_eos": endless,
                "temperature": 0,
            }
            headers = {"x-adaptive-spec-profile": "oneshot" if n % 4 < 2 else "iterative", "x-session-id": f"s{n}"}
            tasks.append(asyncio.create_task(_timed(stream_chat(session, url, body, headers, 120.0, started[n]))))
        # The endless ones that have a slot are streaming; the rest wait for one inside llama-server.
        with_slots = [e for n, e in enumerate(started) if n % 2 == 1][:4]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in with_slots)), 60)
        signalled = time.monotonic()
        proxy.proc.send_signal(signal.SIGTERM)
        results = list(await asyncio.gather(*tasks))
        await asyncio.to_thread(proxy.proc.wait, 60)
        exited = time.monotonic()
    return results, signalled, exited


def run_shutdown(streams: int, grace_s: float, workdir: Path) -> dict[str, Any]:
    model = write_tiny_gguf(workdir / "tiny-random-llama.gguf")
    state = workdir / "state"
    proxy = ProxyProcess(
        "--model",
        str(model),
        "--threads",
        "1",
        "--ctx-size",
        "8192",
        "--parallel",
        "4",
        "--shutdown-grace",
        str(grace_s),
        env={"ADAPTIVE_SPEC_STATE_DIR": str(state), "ADAPTIVE_SPEC_CONFIG_DIR": str(workdir / "config")},
    )
    servers_before = _llama_servers_under(state)
    try:
        timed, signalled, exited = asyncio.run(_streams(proxy, streams))
    finally:
        proxy.stop()
    results = [r for r, _ in timed]
    after_signal = [round(max(0.0, at - signalled), 2) for _, at in timed]
    return {
        "streams": streams,
        "grace_s": grace_s,
        "ended": dict(Counter(r.ended for r in results)),
        "error_codes": dict(Counter(str(r.error_code) for r in results if r.error_code)),
        "statuses": dict(Counter(str(r.status) for r in results)),
        "whole_or_clean_error": sum(1 for r in results if r.ended in ("done", "error-event", "http-error")),
        "stream_end_after_signal_s": {"median": median(after_signal), "max": max(after_signal)},
        "texts_of_whole_answers_nonempty": all(r.text for r in results if r.ended == "done"),
        "proxy_exit_status": proxy.proc.returncode,
        "proxy_exit_after_signal_s": round(exited - signalled, 2),
        "llama_servers_before": len(servers_before),
        "llama_servers_after": len(_llama_servers_under(state)),
        "stopping_line": next((line for line in proxy.stderr_lines if line.startswith("stopping")), None),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--grace", type=float, default=3.0, help="the proxy's --shutdown-grace")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        figures = run_shutdown(args.streams, args.grace, Path(tmp))
    write_figures(figures, args.out)
    ok = figures["whole_or_clean_error"] == args.streams and figures["llama_servers_after"] == 0
    return 0 if ok and figures["proxy_exit_status"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
