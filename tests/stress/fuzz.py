"""Bad input against a real proxy (`serve`'s own start-up, in this process) in front of a real llama-server with a
tiny random-weight model, over raw sockets on loopback. Prints and writes the figures: statuses per kind of case,
5xx answers to bad input, tracebacks and lines in the proxy's log, file descriptors and asyncio tasks before and
after, connections to a canary port the proxy must never contact, and whether the model still answers the same.

Run:  python -m tests.stress.fuzz --count 3000 --out fuzz-3000.json   (from the repository root; --seed to vary)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaptive_spec.llama.profiles import AttachedProfile
from adaptive_spec.proxy.app import ProxySettings
from adaptive_spec.proxy.run import _run
from adaptive_spec.proxy.settings import ServeSettings, SessionSettings
from tests.stress.fuzz_cases import Case, Generator, Target
from tests.support.models.tiny_gguf import write_tiny_gguf
from tests.support.processes.servers import LlamaServer, free_port, http_json, wait_until

_READ_TIMEOUT_S = 60.0
_CONCURRENCY = 8
CHECK_CHAT = {
    "model": "m",
    "max_tokens": 16,
    "temperature": 0,
    "seed": 1,
    "messages": [{"role": "user", "content": "Say something."}],
}


class _LogCapture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(logging.Formatter().format(record))


class InProcessProxy:
    """`serve --profile plain=URL --max-body-mb 1`, run by serve's own `_run` on a loop in a thread."""

    def __init__(self, upstream_url: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        settings = ServeSettings(
            "127.0.0.1",
            self.port,
            ProxySettings(max_body_bytes=1024 * 1024),
            None,
            attach=[AttachedProfile("plain", upstream_url)],
            sessions=SessionSettings(tokenizer="endpoint"),
        )
        self.loop = asyncio.new_event_loop()
        self.stop_event = asyncio.Event()
        self.failure: BaseException | None = None
        self.thread = threading.Thread(target=self._main, args=(settings,), daemon=True)
        self.thread.start()
        wait_until(self._up, 120, f"the proxy on {self.base}", 0.1)

    def _main(self, settings: ServeSettings) -> None:
        try:
            self.loop.run_until_complete(_run(settings, self.stop_event))
        except BaseException as exc:  # reported by _up and stop
            self.failure = exc

    def _up(self) -> bool:
        if self.failure is not None:
            raise AssertionError(f"the proxy failed: {self.failure!r}")
        try:
            return bool(http_json(self.base + "/adaptive/health", timeout=2))
        except OSError:
            return False

    def tasks(self) -> int:
        async def count() -> int:
            return len(asyncio.all_tasks()) - 1  # not this one

        return asyncio.run_coroutine_threadsafe(count(), self.loop).result(10)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(60)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@dataclass
class Figures:
    count: int
    seed: int
    statuses: Counter[str] = field(default_factory=Counter)
    by_kind: dict[str, Counter[str]] = field(default_factory=dict)
    bad_5xx: list[str] = field(default_factory=list)
    valid_not_2xx: list[str] = field(default_factory=list)
    canary_connections: int = 0
    log_lines: int = 0
    tracebacks: int = 0
    fds_before: int = 0
    fds_after: int = 0
    tasks_before: int = 0
    tasks_after: int = 0
    model_answers_same: bool = False
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "seed": self.seed,
            "seconds": round(self.seconds, 1),
            "statuses": dict(sorted(self.statuses.items())),
            "by_kind": {k: dict(sorted(v.items())) for k, v in sorted(self.by_kind.items())},
            "bad_input_5xx": len(self.bad_5xx),
            "bad_input_5xx_examples": self.bad_5xx[:20],
            "valid_not_2xx": len(self.valid_not_2xx),
            "valid_not_2xx_examples": self.valid_not_2xx[:20],
            "canary_connections": self.canary_connections,
            "proxy_log_lines": self.log_lines,
            "proxy_log_tracebacks": self.tracebacks,
            "fds_before": self.fds_before,
            "fds_after": self.fds_after,
            "tasks_before": self.tasks_before,
            "tasks_after": self.tasks_after,
            "model_answers_same": self.model_answers_same,
        }


async def _send(case: Case, port: int) -> tuple[str, bytes]:
    """The answer's status code and its start, or what happened instead ("closed": no answer, "sent": the case hung
    up)."""
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError as exc:
        return f"connect-error:{exc.errno}", b""
    try:
        if case.drip_s:
            step = case.drip_s / max(1, len(case.data))
            for i in range(len(case.data)):
                writer.write(case.data[i : i + 1])
                await writer.drain()
                await asyncio.sleep(step)
        else:
            writer.write(case.data)
            await writer.drain()
        if case.stop_after_send:
            return "sent", b""
        head = await asyncio.wait_for(reader.readline(), _READ_TIMEOUT_S)
        rest = b""
        with contextlib.suppress(OSError, TimeoutError, asyncio.IncompleteReadError):
            rest = await asyncio.wait_for(reader.read(), _READ_TIMEOUT_S)  # the rest, so the proxy's work completes
        parts = head.split()
        status = parts[1].decode() if len(parts) >= 2 and parts[1].isdigit() else "closed"
        return status, rest.partition(b"\r\n\r\n")[2][:300]
    except (ConnectionError, OSError):
        return "reset", b""
    except TimeoutError:
        return "timeout", b""
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def _canary() -> tuple[asyncio.Server, list[int]]:
    hits: list[int] = []

    async def on_connect(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        hits.append(1)
        w.close()

    return await asyncio.start_server(on_connect, "127.0.0.1", 0), hits


async def _fire(cases: list[Case], port: int, figures: Figures) -> None:
    semaphore = asyncio.Semaphore(_CONCURRENCY)

    async def one(case: Case) -> None:
        async with semaphore:
            status, answer = await _send(case, port)
        figures.statuses[status] += 1
        figures.by_kind.setdefault(case.kind, Counter())[status] += 1
        example = f"{case.kind} {status}: {case.data[:1500]!r} -> {answer!r}"
        if case.bad and status.isdigit() and int(status) >= 500:
            figures.bad_5xx.append(example)
        if not case.bad and not (status.isdigit() and 200 <= int(status) < 300):
            figures.valid_not_2xx.append(example)

    await asyncio.gather(*(one(c) for c in cases))


def _chat(base: str) -> str:
    return str(http_json(base + "/v1/chat/completions", CHECK_CHAT)["choices"][0]["message"]["content"])


def _settled_fds(at_most: int | None = None) -> int:
    """The open descriptors once idle connections are gone: pooled upstream connections close 2 s after their last
    use, and the kernel needs a moment for closed client sockets. A leak stays; this waits up to 30 s for the rest."""
    last, steady = -1, 0
    for _ in range(60):
        now = open_fds()
        if at_most is not None and now <= at_most:
            return now
        steady = steady + 1 if now == last else 0
        if at_most is None and steady >= 6:  # the same for 3 s, longer than the pool's idle timeout
            return now
        last = now
        time.sleep(0.5)
    return open_fds()


def run_fuzz(upstream_url: str, count: int, seed: int = 1) -> Figures:
    """Start the proxy in front of `upstream_url`, send `count` generated cases, and measure."""
    capture = _LogCapture()
    logging.getLogger().addHandler(capture)
    proxy = InProcessProxy(upstream_url)
    figures = Figures(count, seed)
    try:
        before = _chat(proxy.base)
        figures.fds_before, figures.tasks_before = _settled_fds(), proxy.tasks()
        started = time.monotonic()

        async def main() -> int:
            server, hits = await _canary()
            canary = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
            cases = list(Generator(seed, Target(f"127.0.0.1:{proxy.port}", canary)).cases(count))
            async with server:
                await _fire(cases, proxy.port, figures)
            return len(hits)

        figures.canary_connections = asyncio.run(main())
        figures.seconds = time.monotonic() - started
        figures.model_answers_same = _chat(proxy.base) == before
        figures.fds_after, figures.tasks_after = _settled_fds(figures.fds_before), proxy.tasks()
    finally:
        proxy.stop()
        logging.getLogger().removeHandler(capture)
    figures.log_lines = sum(len(line.splitlines()) for line in capture.lines)
    figures.tracebacks = sum(line.count("Traceback (most recent call last)") for line in capture.lines)
    return figures


@contextlib.contextmanager
def tiny_llama_server(workdir: Path) -> Iterator[LlamaServer]:
    from adaptive_spec.llama.binary.which import find_llama_server

    model = write_tiny_gguf(workdir / "tiny-random-llama.gguf")
    server = LlamaServer(
        find_llama_server(None), model, "-c", "32768", "--parallel", "1", "--spec-type", "none", log_dir=workdir
    )
    try:
        yield server
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=3000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, tiny_llama_server(Path(tmp)) as server:
        figures = run_fuzz(server.url, args.count, args.seed)
    report = json.dumps(figures.to_json(), indent=2)
    print(report)
    if args.out:
        args.out.write_text(report + "\n")
    ok = not figures.bad_5xx and not figures.tracebacks and figures.model_answers_same
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
