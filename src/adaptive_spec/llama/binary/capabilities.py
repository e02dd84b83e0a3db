"""What a llama-server binary accepts, read once from its `--help` per binary path and modification time.

Today that is one flag: upstream's open #28391 would make `--spec-type` additive, with ngram-mod on by default, and
add `--no-spec-type` to clear the set. A server that lists it gets `--no-spec-type` before its `--spec-type`, so a
draft-only or no-speculation profile does not silently gain ngram-mod.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

from adaptive_spec.common.lru import LRU

_HELP_TIMEOUT_S = 10.0  # a real llama-server prints its help in well under a second
_NO_SPEC_TYPE = re.compile(r"(?<![\w-])--no-spec-type(?![\w-])")


@dataclass(frozen=True, slots=True)
class Capabilities:
    no_spec_type: bool = False  # `--spec-type` adds to a default set that `--no-spec-type` clears

    @classmethod
    def from_help(cls, text: str) -> Capabilities:
        return cls(no_spec_type=_NO_SPEC_TYPE.search(text) is not None)


# A binary that cannot be found or run offers nothing beyond what every supported build takes.
STOCK = Capabilities()
_cache: LRU[tuple[str, int, int], Capabilities] = LRU(16)


def of_binary(binary: str) -> Capabilities:
    """`binary`'s capabilities (a path, or a name looked up on PATH), probed once per path, mtime and size: a
    rebuilt binary is probed again."""
    path = shutil.which(binary) or binary
    try:
        real = os.path.realpath(path)
        st = os.stat(real)
    except OSError:
        return STOCK
    key = (real, st.st_mtime_ns, st.st_size)
    found = _cache.get(key)
    if found is None:
        found = _probe(real)
        _cache.put(key, found)
    return found


def _probe(path: str) -> Capabilities:
    try:
        done = subprocess.run(
            [path, "--help"],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=_HELP_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return STOCK
    # Older builds print the help to stdout, some wrappers to stderr; the exit status says nothing useful.
    return Capabilities.from_help(done.stdout + done.stderr)
