"""The opt-in JSONL trace: one line per generating request (written by the request lifecycle) after a line naming
the profiles (written by `serve` at start), rotated by size.

Prompts are not stored unless asked for (`--trace-content`): a line carries the request body's sha256 and token
counts; with content it also carries the request body and the generated text. A trace that cannot be written (disk
full) never fails a request: the lines are dropped, counted, and the console is told once, and again when it writes
again.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
from pathlib import Path
from typing import IO, Any

import orjson

log = logging.getLogger(__name__)


class TraceWriter:
    def __init__(self, path: Path, *, max_bytes: int = 64 * 1024 * 1024, keep: int = 3, content: bool = False) -> None:
        self.path, self.max_bytes, self.keep, self.content = path, max_bytes, keep, content
        path.parent.mkdir(parents=True, exist_ok=True)
        # Unbuffered: a line that cannot be written is dropped at once, not left in a buffer to block the next ones.
        self._file: IO[bytes] = path.open("ab", buffering=0)
        self.dropped = 0  # lines lost since the trace stopped being writable (0 while it writes)
        self.dropped_total = 0
        self._cut = False  # a line was written in part: the next one starts on a line of its own

    def write(self, line: dict[str, Any]) -> None:
        data = orjson.dumps(line) + b"\n"
        if self._cut:
            data = b"\n" + data
        try:
            self._write_all(data)
        except OSError as exc:
            if self.dropped == 0:
                log.error(
                    "trace: cannot write %s (%s); requests are served as usual, their trace lines are dropped "
                    "until it can be written again",
                    self.path,
                    exc.strerror or exc,
                )
            self.dropped += 1
            self.dropped_total += 1
            return
        if self.dropped:
            log.warning("trace: writing %s again; %d lines were dropped", self.path, self.dropped)
            self.dropped = 0
        if self._file.tell() >= self.max_bytes:
            try:
                self._rotate()
            except OSError as exc:
                log.error("trace: cannot rotate %s (%s)", self.path, exc.strerror or exc)

    def _write_all(self, data: bytes) -> None:
        view, sent = memoryview(data), 0
        try:
            while sent < len(data):
                written = self._file.write(view[sent:])
                if not written:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                sent += written
        finally:
            if sent:  # a line cut off in the middle is ended by the next one's leading newline
                self._cut = sent < len(data)

    def request(self, record: dict[str, Any], body: bytes, output_text: str | None) -> None:
        line: dict[str, Any] = {"kind": "request", **record, "request_sha256": hashlib.sha256(body).hexdigest()}
        if self.content:
            try:
                line["request_body"] = orjson.loads(body) if body else None
            except orjson.JSONDecodeError:
                line["request_body"] = body.decode("utf-8", "replace")
            line["output_text"] = output_text
        self.write(line)

    def _rotate(self) -> None:
        self._file.close()
        try:
            for i in range(self.keep - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{i}")
                if older.exists():
                    os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
            if self.path.exists():  # it may have been moved away meanwhile
                os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
            self.path.with_name(f"{self.path.name}.{self.keep + 1}").unlink(missing_ok=True)
        finally:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("ab", buffering=0)

    def close(self) -> None:
        self._file.close()
