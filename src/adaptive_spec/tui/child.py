"""`serve --tui`: the proxy as a child process of the TUI, in a session of its own (keys reach the TUI, not serve),
its output read line by line for the log, and stopped when the TUI quits."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

STOP_GRACE_S = 30.0  # serve stops its llama-servers first: SIGKILL only after this long


class ServeChild:
    def __init__(self, argv: Sequence[str]) -> None:
        self.argv = list(argv)
        self.process: asyncio.subprocess.Process | None = None

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    async def lines(self) -> AsyncIterator[str]:
        """Starts it; then each non-empty line it prints (stdout and stderr together), until it closes them."""
        self.process = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
        assert self.process.stdout is not None
        async for raw in self.process.stdout:
            line = raw.decode("utf-8", "replace").rstrip()
            if line:
                yield line

    async def wait(self) -> int:
        assert self.process is not None
        return await self.process.wait()

    async def stop(self) -> int | None:
        """SIGTERM, then SIGKILL if it is still there after STOP_GRACE_S; returns its exit code."""
        process = self.process
        if process is None or process.returncode is not None:
            return None if process is None else process.returncode
        process.terminate()
        try:
            async with asyncio.timeout(STOP_GRACE_S):
                await process.wait()
        except TimeoutError:
            process.kill()
            await process.wait()
        return process.returncode
