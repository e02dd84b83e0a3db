"""The one llama-server a sweep speaks to directly (load_sweep.py, settings_sweep.py), restartable: a
restart empties its n-gram pool and its slots' prompt caches."""

from __future__ import annotations

from pathlib import Path

from adaptive_spec.llama.launch import ServerProcess, free_port
from adaptive_spec.llama.profiles import ProfileSpec, ServerSettings, server_argv


class SweepServer:
    def __init__(
        self, name: str, binary: str, spec: ProfileSpec, settings: ServerSettings, home: Path, log: Path
    ) -> None:
        self.name, self.binary, self.spec, self.settings, self.log = name, binary, spec, settings, log
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self.argv = server_argv(binary, spec, settings, host="127.0.0.1", port=self.port, slot_save_path=str(home))
        self.process: ServerProcess | None = None
        self.starts = 0

    async def start(self) -> None:
        await self.stop()
        self.process = ServerProcess(self.name, list(self.argv), self.url, self.log, say=_quiet)
        await self.process.start(health_timeout_s=300)
        self.starts += 1

    async def stop(self) -> None:
        if self.process is not None:
            await self.process.stop()
            self.process = None


def _quiet(_line: str) -> None:
    pass
