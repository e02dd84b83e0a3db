"""Real processes for tests: llama-server instances and the adaptive-spec CLI, started and always stopped."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

from adaptive_spec.llama import launch as launcher
from adaptive_spec.llama.launch import ServerProcess


def free_port() -> int:
    """A free loopback port, found as the launcher finds its profiles' ports (the one way, for tests too)."""
    return launcher.free_port("127.0.0.1")


def http_json(url: str, body: Any = None, timeout: float = 60.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def http_text(url: str, timeout: float = 30.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return str(resp.read().decode())


def wait_until(predicate: Any, timeout: float, what: str, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def terminate(proc: subprocess.Popen[Any], grace_s: float) -> None:
    """SIGTERM, then SIGKILL if it is still there after `grace_s`."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is gone for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def child_pids(parent: int) -> list[int]:
    """The live (not zombie) child processes of `parent`, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == parent and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def llama_children(proxy: ProxyProcess) -> dict[int, str]:
    """The llama-servers a `serve` process launched, by pid: "iterative" for the one drafting with ngram-mod, else
    "oneshot"."""
    pids = {}
    for pid in child_pids(proxy.proc.pid):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        if cmdline and cmdline[0].endswith(b"llama-server"):
            pids[pid] = "iterative" if b"ngram-mod" in cmdline else "oneshot"
    return pids


class LlamaServer:
    """One real llama-server process on a free loopback port, started by the product's own `ServerProcess` (its own
    session, ended with its parent, the SIGILL retry) on an event loop of its own, so synchronous tests can hold it.
    The one way the tests start llama-server; `model` None starts it without one (router mode: `--models-preset`);
    `port`: where a server comes back that another one left (a replica restarted, or replaced by another model);
    `host` and `wrap`: the address it serves on and the argv prefix that starts it elsewhere (another host's network
    namespace, `tests/support/processes/hosts.py`)."""

    def __init__(
        self,
        binary: str,
        model: Path | None,
        *args: str,
        log_dir: Path,
        port: int | None = None,
        host: str = "127.0.0.1",
        wrap: Sequence[str] = (),
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"llama-server-{self.port}-{time.monotonic_ns()}.log"
        argv = [*wrap, binary, *(["-m", str(model)] if model is not None else [])]
        argv += ["--host", host, "--port", str(self.port), "-t", "1", "--jinja", *args]
        self._server = ServerProcess(f"test-{self.port}", argv, self.url, self.log_path, say=lambda _line: None)
        # The loop's thread starts the child, and a child started with PR_SET_PDEATHSIG ends when that thread does:
        # the thread lives as long as this server.
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        try:
            self._run(self._server.start(health_timeout_s=120))
        except BaseException:
            self.stop()
            raise

    def _run(self, work: Coroutine[Any, Any, object]) -> None:
        asyncio.run_coroutine_threadsafe(work, self._loop).result()

    @property
    def pid(self) -> int:
        process = self._server.process
        assert process is not None
        return process.pid

    def slot_busy(self) -> bool:
        return any(bool(s.get("is_processing")) for s in http_json(self.url + "/slots"))

    def metrics(self) -> dict[str, float]:
        values: dict[str, float] = {}
        for line in http_text(self.url + "/metrics").splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def stop(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self._server.stop())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
            self._loop.close()


class ProxyProcess:
    """`adaptive-spec serve ...` as a user runs it, in its own process; waits for the printed base URL. `host` and
    `wrap` as for `LlamaServer` (beyond loopback, `serve` wants `--host` and a key or `--insecure-no-key` in `args`)."""

    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        ready_timeout: float = 300.0,
        port: int | None = None,
        host: str = "127.0.0.1",
        wrap: Sequence[str] = (),
    ) -> None:
        self.port = port or free_port()
        self.base = f"http://{host}:{self.port}"
        argv = [*wrap, sys.executable, "-m", "adaptive_spec", "serve", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.stderr_lines: list[str] = []
        self.stdout_lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.stdout_lines, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr_lines, False), daemon=True).start()
        deadline = time.monotonic() + ready_timeout
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.wait(5) if self.proc.poll() is None else None
                self.stop()
                raise AssertionError("adaptive-spec serve did not start:\n" + self.log())

    def _pump(self, stream: Any, sink: list[str], watch: bool) -> None:
        for line in stream:
            sink.append(line.rstrip("\n"))
            if watch and line.startswith("OPENAI_BASE_URL="):
                self._ready.set()

    def log(self) -> str:
        return "\n".join(self.stdout_lines + self.stderr_lines)

    def requests(self) -> list[dict[str, Any]]:
        return list(http_json(self.base + "/adaptive/requests")["requests"])

    def send_signal(self, sig: signal.Signals) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(60)

    def stop(self) -> None:
        terminate(self.proc, 30)


def chat_record(proxy: ProxyProcess, messages: list[dict[str, str]], max_tokens: int, **headers: str) -> dict[str, Any]:
    """One greedy, non-streamed chat request through the proxy; its record from /adaptive/requests, with the reply's
    text added."""
    body = {"model": "m", "messages": messages, "temperature": 0, "seed": 1, "max_tokens": max_tokens}
    return body_record(proxy, body, headers)


def body_record(proxy: ProxyProcess, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    """`chat_record` of any chat body."""
    req = urllib.request.Request(
        proxy.base + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        reply = json.loads(resp.read())
        request_id = resp.headers["x-adaptive-spec-request-id"]
    record = next(r for r in proxy.requests() if r["request_id"] == request_id)
    return {**record, "text": reply["choices"][0]["message"]["content"]}
