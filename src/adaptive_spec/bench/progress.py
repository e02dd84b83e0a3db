"""The bench's progress: a bar redrawn in place on a terminal, one plain line per request elsewhere (a log file
keeps readable lines instead of a run-on string of carriage returns)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TextIO

WIDTH = 28


def bar(done: int, total: int, width: int = WIDTH) -> str:
    """`[#######-------]  12/96`: filled in proportion to what is done."""
    filled = width * done // total if total else width
    return f"[{'#' * filled}{'-' * (width - filled)}] {done:>{len(str(total))}}/{total}"


def eta(elapsed_s: float, done: int, total: int) -> str:
    """Remaining time at the pace so far, e.g. '3m20s left'; empty before the first request ends."""
    if not done or done >= total:
        return ""
    left = round(elapsed_s / done * (total - done))
    return f"{left // 60}m{left % 60:02d}s left" if left >= 60 else f"{left}s left"


@dataclass
class Progress:
    stream: TextIO
    total: int
    tty: bool
    _started: float = field(default_factory=time.monotonic)
    _width: int = 0

    def step(self, done: int, what: str) -> None:
        if not self.tty:
            print(f"[{done}/{self.total}] {what}", file=self.stream, flush=True)
            return
        line = f"{bar(done, self.total)} {eta(time.monotonic() - self._started, done, self.total):>10} {what}"
        print("\r" + line.ljust(self._width), end="", file=self.stream, flush=True)
        self._width = len(line)

    def note(self, message: str) -> None:
        """A message of its own line, without breaking the bar."""
        if self.tty and self._width:
            print(file=self.stream)
            self._width = 0
        print(message, file=self.stream, flush=True)

    def close(self) -> None:
        if self.tty and self._width:
            print(file=self.stream, flush=True)
            self._width = 0
