"""A real redis-server for the tests of the shared state, on a free port, stopped and started again on that port at
will (the outage tests). Without the distribution's `redis-server` a test skips here and fails in CI (`.ci/run`
installs it and says so with ADAPTIVE_SPEC_NEEDS_REDIS)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import redis

from tests.support.processes.outside import missing
from tests.support.processes.servers import free_port, terminate


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        what = "redis-server not found (Debian: apt-get install redis-server)"
        if os.environ.get("ADAPTIVE_SPEC_NEEDS_REDIS"):
            pytest.fail(f"{what} (CI must have it: .ci/run installs everything)")
        missing(what)
    return found


class RedisServer:
    """`redis-server` with nothing saved to disk, on 127.0.0.1 and a port of its own; or on `host`, the address of a
    host of `tests/support/processes/hosts.py` whose `run` prefix is `wrap`."""

    def __init__(
        self, work: Path, password: str | None = None, host: str = "127.0.0.1", wrap: Sequence[str] = ()
    ) -> None:
        self.binary, self.work, self.password = redis_binary(), work, password
        self.host, self.wrap = host, list(wrap)
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}{self.host}:{self.port}/0"

    def start(self) -> None:
        argv = [
            *self.wrap,
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        argv += ["--dir", str(self.work)] + (["--requirepass", self.password] if self.password else [])
        log = (self.work / "redis.log").open("ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                if self.client().ping():
                    return
            except redis.exceptions.ConnectionError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("redis-server did not start: " + (self.work / "redis.log").read_text())
            time.sleep(0.02)

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=2)

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc, 10)
            self.proc = None
        # Its port refuses connections from now on (nothing else was given it).
        with socket.socket() as probe:
            probe.settimeout(5)
            assert probe.connect_ex((self.host, self.port)) != 0
