"""`adaptive-spec kv-relay` as a user runs it, in its own process, for tests; and raw HTTP calls to it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.support.processes.servers import free_port, terminate


class RelayProcess:
    def __init__(
        self,
        slot_dir: Path,
        model: Path,
        key: str,
        *args: str,
        server: str | None = None,
        env: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        wrap: Sequence[str] = (),
    ) -> None:
        """`host` and `wrap`: the address it serves on and the argv prefix that starts it on another host."""
        self.port = free_port()
        self.base = f"http://{host}:{self.port}"
        self.key = key
        argv = [*wrap, sys.executable, "-m", "adaptive_spec", "kv-relay"]
        argv += ["--slot-dir", str(slot_dir), "--model", str(model)]
        argv += ["--host", host, "--port", str(self.port), *args] + (["--server", server] if server else [])
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "ADAPTIVE_SPEC_RELAY_KEY": key, **(env or {})},
        )
        threading.Thread(target=self._pump, daemon=True).start()
        deadline = time.monotonic() + 60
        while not self._ready.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError("kv-relay did not start:\n" + "\n".join(self.lines))

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))
            if line.startswith("KV_RELAY_URL="):
                self._ready.set()

    def call(
        self, method: str, path: str, data: bytes | None = None, headers: dict[str, str] | None = None, key: bool = True
    ) -> tuple[int, dict[str, str], bytes]:
        """One request; (status, headers, body) whatever the status."""
        sent = {"Authorization": f"Bearer {self.key}"} if key else {}
        req = urllib.request.Request(self.base + path, data=data, method=method, headers={**sent, **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return resp.status, dict(resp.headers), resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, dict(exc.headers), exc.read()

    def stop(self) -> None:
        terminate(self.proc, 10)


def error_of(body: bytes) -> dict[str, Any]:
    import json

    return dict(json.loads(body)["error"])
