"""The bench's machine-load sampling (parsed from /proc text), its warning, the progress display and the outputs."""

from __future__ import annotations

import io
import json
from pathlib import Path

from adaptive_spec.bench import machine
from adaptive_spec.bench.compare import BEST_SEEN, BEST_STATIC
from adaptive_spec.bench.machine import Busy, LoadSample
from adaptive_spec.bench.progress import Progress, bar, eta
from adaptive_spec.bench.runner import write_outputs
from tests.support.bench_records import two_statics_and_adaptive

STAT = "cpu  491399 0 52503 58428 1075 0 1319 3943 0 0\ncpu0 243480 0 25468 32970 121 0 377 1896 0 0\n"


def test_proc_stat_lines_parse() -> None:
    cpu = machine.parse_cpu_line(STAT)
    assert cpu == machine.CpuTimes(491399 + 52503 + 58428 + 1075 + 1319 + 3943, 58428 + 1075, 3943)
    old_kernel = machine.parse_cpu_line("cpu  10 0 5 100 1 0 0\n")
    assert old_kernel is not None and old_kernel.steal is None
    assert machine.parse_cpu_line("intr 1 2 3\n") is None
    line = "4827 (tmux: server (1)) R 4824 4824 3654 0 -1 4194304 121 0 0 0 250 31 0 0 20 0 1 0 304594"
    assert machine.parse_process_stat(line) == ("tmux: server (1)", 281)
    assert machine.parse_process_stat("garbage") is None
    assert machine.parse_loadavg("1.15 3.27 11.67 2/300 4242\n") == (1.15, 3.27, 11.67)


def test_busiest_processes_come_first() -> None:
    before = {1: ("idle", 100), 2: ("cc1plus", 1000), 3: ("python", 500)}
    after = {1: ("idle", 100), 2: ("cc1plus", 1100), 3: ("python", 550), 4: ("new", 9)}
    assert machine.busiest(before, after, window_s=1.0, ticks_per_s=100) == (
        Busy(2, "cc1plus", 1.0),
        Busy(3, "python", 0.5),
    )


def _sample(busy: float, steal: float | None) -> LoadSample:
    return LoadSample(0.0, (1.0, 1.0, 1.0), 2, busy, steal, ())


def test_a_change_that_matters_is_warned_about() -> None:
    assert machine.judge(_sample(0.1, 1.0), _sample(0.3, 2.0)) is None
    assert machine.judge(_sample(0.1, None), _sample(1.2, None)) == "other work went from 0.10 to 1.20 busy cores"
    assert machine.judge(_sample(0.1, 1.0), _sample(0.1, 9.0)) == "CPU steal went from 1% to 9%"
    assert machine.judge(_sample(2.0, 0.0), _sample(1.7, 0.0)) == "other work kept 1.70 of 2 cores busy"


def test_a_real_sample_of_this_machine_has_its_fields() -> None:
    found = machine.sample(window_s=0.05)
    assert found.cores >= 1 and found.load_avg is not None
    if Path("/proc/stat").exists():
        assert found.busy_cores is not None and 0.0 <= found.busy_cores <= found.cores + 0.01


def test_progress_is_a_bar_on_a_terminal_and_lines_elsewhere() -> None:
    assert bar(12, 96, width=8) == "[#-------] 12/96"
    assert bar(96, 96, width=8) == "[########] 96/96"
    assert eta(10.0, 1, 4) == "30s left" and eta(60.0, 1, 3) == "2m00s left" and eta(1.0, 0, 3) == ""
    log = io.StringIO()
    plain = Progress(log, 2, tty=False)
    plain.step(1, "mixed: request 1 on adaptive")
    plain.step(2, "mixed: request 2 on adaptive")
    assert log.getvalue() == "[1/2] mixed: request 1 on adaptive\n[2/2] mixed: request 2 on adaptive\n"
    term = io.StringIO()
    live = Progress(term, 2, tty=True)
    live.step(1, "one")
    live.note("warning: busy")
    live.close()
    assert term.getvalue().startswith("\r[##############--------------] 1/2")
    assert term.getvalue().endswith("\nwarning: busy\n")


def test_outputs_carry_intervals_verdicts_and_load(tmp_path: Path) -> None:
    records = {"mixed": two_statics_and_adaptive(adaptive_speed=80)}
    known = [{"name": "oneshot", "spec_types": ["none"]}, {"name": "iterative", "spec_types": ["ngram-mod"]}]
    load = [{"workload": "mixed", "target": "adaptive", "round": 0, "warning": "CPU steal went from 1% to 9%"}]
    text = write_outputs(records, known, tmp_path, load)
    assert "adaptive vs iterative: decode tok/s 1.000× [1.000, 1.000] indistinguishable" in text
    assert f"adaptive vs {BEST_STATIC} (not an upper bound): decode tok/s" in text
    assert f"adaptive vs {BEST_SEEN} (an upper bound): decode tok/s" in text
    assert "| iterative | 16 | 1600 |" in text and "| 2.00 [2.00, 2.00] |" in text  # × baseline, with its interval
    assert "warning: other work on the machine may have moved the figures of 1 pass(es)" in text
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["load"] == load
    assert {v["against"] for v in result["verdicts"]} == {"oneshot", "iterative", BEST_STATIC, BEST_SEEN}
    oneshot = next(v for v in result["verdicts"] if v["against"] == "oneshot")
    assert oneshot["decode_tok_s"]["verdict"] == "faster" and oneshot["decode_tok_s"]["low"] > 1.0
    assert {i["name"] for i in result["intervals"]} == {"oneshot", "iterative", "adaptive", BEST_STATIC, BEST_SEEN}
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "bench.csv").read_text().count("\n") == 6
