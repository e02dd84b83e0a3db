"""The result file every benchmark writes: its figures under `figures`, and under `run` what they were measured on —
the commit (and whether the tree had changes), the machine, its load when the file was written (and at the start
when the script sampled it), the command line and the time. `read` gives a file's figures back, whoever wrote it."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from adaptive_spec.bench import machine
from benchmarks.harness import ROOT


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _cpu_model() -> str | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or None
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return None


def run_info(started: machine.LoadSample | None = None, *, sample_now: bool = True) -> dict[str, Any]:
    """What a result was measured on. `sample_now` reads the load over one second (the default: a figure without the
    machine's load beside it cannot be judged on a shared machine)."""
    now = machine.sample() if sample_now else None
    status = _git("status", "--porcelain")
    return {
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(status) if status is not None else None,
        "machine": {
            "cpu": _cpu_model(),
            "cores": os.cpu_count(),
            "system": platform.platform(),
            "python": platform.python_version(),
        },
        "load_at_start": asdict(started) if started else None,
        "load_at_end": asdict(now) if now else None,
        "load_changed": machine.judge(started, now) if started and now else None,
        "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
        "written_unix": round(time.time(), 3),
    }


def write(out: Path, benchmark: str, figures: Mapping[str, Any], *, started: machine.LoadSample | None = None) -> Path:
    """Write `figures` with what they were measured on to `out` (folders made); returns `out`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {"benchmark": benchmark, "run": run_info(started), "figures": dict(figures)}
    out.write_text(json.dumps(document, indent=2, default=str) + "\n")
    return out


def read(path: Path) -> dict[str, Any]:
    """The figures of a result file; a file written before the harness (no `figures` key) is its own figures."""
    document = json.loads(path.read_text())
    if not isinstance(document, dict):
        raise ValueError(f"{path}: a result file holds an object, not {type(document).__name__}")
    figures = document.get("figures", document) if "run" in document else document
    if not isinstance(figures, dict):
        raise ValueError(f"{path}: figures: an object, not {type(figures).__name__}")
    return figures
