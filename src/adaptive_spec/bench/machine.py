"""The machine's load around each bench pass: load average, CPU steal and the busiest other processes, sampled over
a short window while the bench's own servers sit idle (before a pass's restarts, after its last request), and a
warning when it changed enough between a pass's start and end to move its figures.

Parsing and judging are pure (tested on /proc text); `sample()` is the thin part that reads /proc and sleeps.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

WINDOW_S = 1.0
# Another process taking half a core more (or less) between a pass's start and end is enough to move decode speeds
# on a small machine (llama-server runs one thread per profile here); steal moving by 5 points likewise.
CORES_CHANGE = 0.5
STEAL_CHANGE = 5.0
# Other work taking three quarters of the machine at both ends: no change to warn about, but figures from a saturated
# machine are slow and noisy, and the reader should know.
SATURATED = 0.75


@dataclass(frozen=True, slots=True)
class CpuTimes:
    total: int
    idle: int  # idle + iowait
    steal: int | None  # None where the kernel's /proc/stat does not show it


@dataclass(frozen=True, slots=True)
class Busy:
    pid: int
    command: str
    cores: float  # CPU over the window, in cores (1.0 = one core fully busy)


@dataclass(frozen=True, slots=True)
class LoadSample:
    at_unix: float
    load_avg: tuple[float, float, float] | None
    cores: int
    busy_cores: float | None  # the whole machine, over the window
    steal_pct: float | None  # share of CPU time stolen by the hypervisor over the window
    busiest: tuple[Busy, ...]  # other processes, busiest first


def parse_cpu_line(stat_text: str) -> CpuTimes | None:
    """The aggregate `cpu` line of /proc/stat: user nice system idle iowait irq softirq [steal ...]."""
    for line in stat_text.splitlines():
        parts = line.split()
        if parts and parts[0] == "cpu" and len(parts) >= 5:
            values = [int(v) for v in parts[1:]]
            idle = values[3] + (values[4] if len(values) > 4 else 0)
            steal = values[7] if len(values) > 7 else None
            # guest time is already counted in user time
            return CpuTimes(sum(values[:8]), idle, steal)
    return None


def parse_process_stat(text: str) -> tuple[str, int] | None:
    """(command, utime + stime in ticks) from /proc/PID/stat; the command may hold spaces and parentheses."""
    open_, close = text.find("("), text.rfind(")")
    if open_ < 0 or close < open_:
        return None
    fields = text[close + 2 :].split()
    if len(fields) < 13:
        return None
    return text[open_ + 1 : close], int(fields[11]) + int(fields[12])


def parse_loadavg(text: str) -> tuple[float, float, float] | None:
    parts = text.split()
    if len(parts) < 3:
        return None
    return float(parts[0]), float(parts[1]), float(parts[2])


def busiest(
    before: Mapping[int, tuple[str, int]], after: Mapping[int, tuple[str, int]], window_s: float, ticks_per_s: int
) -> tuple[Busy, ...]:
    """Processes that used CPU between two readings, busiest first (at most five)."""
    used = []
    for pid, (command, ticks) in after.items():
        if pid in before:
            cores = (ticks - before[pid][1]) / ticks_per_s / window_s
            if cores > 0:
                used.append(Busy(pid, command, round(cores, 3)))
    return tuple(sorted(used, key=lambda b: -b.cores)[:5])


def judge(start: LoadSample, end: LoadSample) -> str | None:
    """A warning when the machine's load moved enough between a pass's start and end to matter, or stayed saturated
    by other work, else None."""
    reasons = []
    if start.busy_cores is not None and end.busy_cores is not None:
        change = end.busy_cores - start.busy_cores
        if abs(change) >= CORES_CHANGE:
            reasons.append(f"other work went from {start.busy_cores:.2f} to {end.busy_cores:.2f} busy cores")
        elif min(start.busy_cores, end.busy_cores) >= SATURATED * start.cores:
            reasons.append(f"other work kept {min(start.busy_cores, end.busy_cores):.2f} of {start.cores} cores busy")
    before, after = start.steal_pct, end.steal_pct
    if before is not None and after is not None and abs(after - before) >= STEAL_CHANGE:
        reasons.append(f"CPU steal went from {before:.0f}% to {after:.0f}%")
    return "; ".join(reasons) or None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def _processes(own: int) -> dict[int, tuple[str, int]]:
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != own:
            parsed = parse_process_stat(_read(entry / "stat") or "")
            if parsed is not None:
                out[int(entry.name)] = parsed
    return out


def sample(window_s: float = WINDOW_S) -> LoadSample:
    """Read the machine's load over `window_s` (blocking: call it off the event loop). Where /proc is missing (not
    Linux), only what the OS offers is filled in."""
    cores = os.cpu_count() or 1
    try:
        load: tuple[float, float, float] | None = os.getloadavg()
    except OSError:
        load = parse_loadavg(_read(Path("/proc/loadavg")) or "")
    stat = Path("/proc/stat")
    cpu0 = parse_cpu_line(_read(stat) or "")
    if cpu0 is None:
        return LoadSample(time.time(), load, cores, None, None, ())
    own = os.getpid()
    procs0 = _processes(own)
    started = time.monotonic()
    time.sleep(window_s)
    cpu1, procs1 = parse_cpu_line(_read(stat) or ""), _processes(own)
    elapsed = time.monotonic() - started
    if cpu1 is None or cpu1.total <= cpu0.total:
        return LoadSample(time.time(), load, cores, None, None, ())
    total = cpu1.total - cpu0.total
    busy = cores * (total - (cpu1.idle - cpu0.idle)) / total
    steal = 100.0 * (cpu1.steal - cpu0.steal) / total if cpu1.steal is not None and cpu0.steal is not None else None
    ticks = os.sysconf("SC_CLK_TCK")
    return LoadSample(time.time(), load, cores, round(busy, 3), steal, busiest(procs0, procs1, elapsed, ticks))
