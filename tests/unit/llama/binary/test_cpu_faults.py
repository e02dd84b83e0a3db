"""llama/binary/cpu_faults.py: which exit statuses are a CPU-kernel fault, the CPU's identity, and the verdict file."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from adaptive_spec.llama.binary.cpu_faults import VerdictStore, build_identity, cpu_identity, fault_signal

CPUINFO = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse avx512f amx_tile amx_int8 amx_bf16

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse avx512f amx_tile amx_int8 amx_bf16
"""


@pytest.mark.parametrize(
    ("returncode", "expected"),
    [
        (-signal.SIGILL, signal.SIGILL),
        (-signal.SIGSEGV, signal.SIGSEGV),
        (-signal.SIGBUS, signal.SIGBUS),
        (128 + signal.SIGSEGV, signal.SIGSEGV),  # a wrapper that exits as a shell does
        (128 + signal.SIGILL, signal.SIGILL),
        (-signal.SIGKILL, None),  # killed from outside: not the CPU
        (-signal.SIGTERM, None),
        (1, None),  # a bad argument, a missing model
        (0, None),
        (None, None),
        (signal.SIGSEGV, None),  # exit(11) is an ordinary status, not the signal
    ],
)
def test_fault_signal(returncode: int | None, expected: signal.Signals | None) -> None:
    assert fault_signal(returncode) == expected


def test_cpu_identity_reads_the_model_and_digests_the_flags_in_any_order() -> None:
    model, flags = cpu_identity(CPUINFO)
    assert model == "Intel(R) Xeon(R) Platinum 8480+"
    assert flags == cpu_identity(CPUINFO.replace("amx_tile amx_int8", "amx_int8 amx_tile"))[1]
    assert flags != cpu_identity(CPUINFO.replace(" amx_tile amx_int8 amx_bf16", ""))[1]
    assert cpu_identity("")[0] == "unknown CPU"


def _binary(tmp_path: Path, name: str = "llama-server") -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n")
    path.chmod(0o755)
    return str(path)


def test_a_verdict_is_kept_per_build_and_cpu(tmp_path: Path) -> None:
    binary = _binary(tmp_path)
    store = VerdictStore(tmp_path / "state" / "cpu-verdicts.json", cpuinfo=CPUINFO)
    assert store.get(binary) is None
    assert store.remember(binary, signal.SIGSEGV) is None
    verdict = store.get(binary)
    assert verdict is not None and verdict.fault == "SIGSEGV" and verdict.cpu.startswith("Intel")
    assert "--no-repack" in verdict.describe() and "SIGSEGV" in verdict.describe()
    # Read again by a new process's store: the file is the memory.
    assert VerdictStore(store.path, cpuinfo=CPUINFO).get(binary) == verdict
    # Another CPU (the VM moved to a host without AMX) has no verdict, nor has another build.
    assert VerdictStore(store.path, cpuinfo=CPUINFO.replace(" amx_bf16", "")).get(binary) is None
    assert store.get(_binary(tmp_path, "other-llama-server")) is None
    # A rebuild in place is a new build.
    before = build_identity(binary)
    Path(binary).write_text("#!/bin/sh\n# rebuilt\n")
    assert build_identity(binary) != before and store.get(binary) is None
    assert store.forget() == 1 and store.all() == []


@pytest.mark.parametrize("content", ["not json", "[1, 2]", '{"k": {"build": "b"}}', '{"k": 3}'])
def test_an_unreadable_verdict_file_counts_as_none(tmp_path: Path, content: str) -> None:
    binary = _binary(tmp_path)
    path = tmp_path / "cpu-verdicts.json"
    path.write_text(content)
    store = VerdictStore(path, cpuinfo=CPUINFO)
    assert store.get(binary) is None and store.all() == []
    assert store.remember(binary, signal.SIGILL) is None  # and it is written afresh
    assert store.get(binary) is not None


def test_a_verdict_that_cannot_be_written_is_said(tmp_path: Path) -> None:
    blocker = tmp_path / "state"
    blocker.write_text("a file where the state directory should be")
    problem = VerdictStore(blocker / "cpu-verdicts.json", cpuinfo=CPUINFO).remember(_binary(tmp_path), signal.SIGILL)
    assert problem is not None and "cannot keep the verdict" in problem
