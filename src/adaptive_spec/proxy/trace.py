"""The opt-in JSONL trace: one line per request (and per session turn), rotated by size.

Prompts are not stored unless asked for (`--trace-content`): a line carries the request body's sha256 and token
counts; with content it also carries the request body and the generated text.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import IO, Any

import orjson


class TraceWriter:
    def __init__(self, path: Path, *, max_bytes: int = 64 * 1024 * 1024, keep: int = 3, content: bool = False) -> None:
        self.path, self.max_bytes, self.keep, self.content = path, max_bytes, keep, content
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[bytes] = path.open("ab")

    def write(self, line: dict[str, Any]) -> None:
        self._file.write(orjson.dumps(line) + b"\n")
        self._file.flush()
        if self._file.tell() >= self.max_bytes:
            self._rotate()

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
            self._file = self.path.open("ab")

    def close(self) -> None:
        self._file.close()
