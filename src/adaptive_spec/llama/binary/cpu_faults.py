"""What a llama-server's death while loading says about the CPU it runs on, and the verdict this machine keeps.

Some machines advertise instructions (AMX, on virtual machines) that fault when used: llama.cpp reaches them only
through weight repacking, so a build that dies of SIGILL, SIGSEGV or SIGBUS while loading runs once `--no-repack` is
given (llama.cpp #20824). The verdict is kept per build and CPU, and only once the retry has served, so the next
start goes straight to the arguments that work instead of crashing first.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

NO_REPACK = "--no-repack"
# auto: retry a loading fault with --no-repack and remember it; always: never add it (a user who knows the machine);
# never: always pass it.
RepackMode = Literal["auto", "always", "never"]
REPACK_MODES: tuple[RepackMode, ...] = ("auto", "always", "never")
LOADING_FAULTS = (signal.SIGILL, signal.SIGSEGV, signal.SIGBUS)
VERDICTS_FILE = "cpu-verdicts.json"
CLEAR_HINT = "`adaptive-spec build-server --forget-cpu-verdicts` clears it, `serve --cpu-repack always` ignores it"
# Said wherever a verdict is, so a user can weigh it (docs/benchmarks.md, "What --no-repack costs": medians of
# benchmarks/cpu/repack_cost.py; on a machine that faults the repacked speed cannot be had at all).
REPACK_COST = (
    "without repacking, prefill ran at 0.98-1.64x and decode at 0.74-1.05x the repacked speed "
    "(the embedded 0.5B and 1.5B on a 2-core x86 CPU: docs/benchmarks.md)"
)


def fault_signal(returncode: int | None) -> signal.Signals | None:
    """The CPU-kernel fault a process's exit status names: killed by the signal (-N), or a wrapper that exited with
    128 + N as shells do; None for any other ending."""
    if returncode is None:
        return None
    number = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
    for fault in LOADING_FAULTS:
        if number == fault.value:
            return fault
    return None


def cpu_identity(cpuinfo: str) -> tuple[str, str]:
    """(model name, digest of the flags) from /proc/cpuinfo's first processor: the flags are what decides whether a
    kernel faults; the model name is what a person reads."""
    model, flags = "unknown CPU", ""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown CPU":
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = " ".join(sorted(value.split()))
        if not line.strip() and flags:
            break
    return model, hashlib.sha256(flags.encode()).hexdigest()[:16]


def build_identity(binary: str) -> str:
    """A build as the file that runs: its resolved path, size and modification time (a rebuild is a new build)."""
    path = Path(binary).resolve()
    try:
        st = path.stat()
    except OSError:
        return str(path)
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


def _read_cpuinfo() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/cpuinfo").read_text(errors="replace")
    return ""


@dataclass(frozen=True)
class Verdict:
    """Why a build on this CPU runs with `--no-repack`."""

    build: str
    cpu: str
    fault: str  # the signal's name it died of while loading
    recorded: float  # time.time()

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d", time.localtime(self.recorded))
        return f"{NO_REPACK} (it died of {self.fault} while loading with repacking on {self.cpu}, {when})"


class VerdictStore:
    """The verdicts of this machine, one JSON file in the state directory. A file that cannot be read counts as no
    verdict (the next start finds out again); one that cannot be written is said, not raised."""

    def __init__(self, path: Path, cpuinfo: str | None = None) -> None:
        self.path = path
        model, flags = cpu_identity(_read_cpuinfo() if cpuinfo is None else cpuinfo)
        self.cpu_model, self._cpu_flags = model, flags

    def _key(self, binary: str) -> str:
        return hashlib.sha256(f"{build_identity(binary)}|{self._cpu_flags}".encode()).hexdigest()[:24]

    def _load(self) -> dict[str, object]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, binary: str) -> Verdict | None:
        return _verdict(self._load().get(self._key(binary)))

    def all(self) -> list[Verdict]:
        found = [_verdict(entry) for entry in self._load().values()]
        return [v for v in found if v is not None]

    def remember(self, binary: str, fault: signal.Signals) -> str | None:
        """Keep the verdict for this build on this CPU; the problem as a sentence if the file cannot be written."""
        data = self._load()
        data[self._key(binary)] = {
            "build": build_identity(binary),
            "cpu": self.cpu_model,
            "fault": fault.name,
            "recorded": time.time(),
        }
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            tmp.replace(self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            return f"cannot keep the verdict in {self.path}: {exc.strerror or exc}"
        return None

    def forget(self) -> int:
        """Drop every verdict; how many there were."""
        count = len(self._load())
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        return count


def _verdict(entry: object) -> Verdict | None:
    if not isinstance(entry, dict):
        return None
    try:
        return Verdict(str(entry["build"]), str(entry["cpu"]), str(entry["fault"]), float(entry["recorded"]))
    except (KeyError, TypeError, ValueError):
        return None
