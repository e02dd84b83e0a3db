"""`adaptive-spec bench` against a REAL launched proxy (tiny model): every target runs, outputs are written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.processes.servers import ProxyProcess


def test_bench_runs_every_target_and_writes_its_outputs(
    tiny_gguf: Path, tmp_path: Path, llama_server_binary: str
) -> None:
    proxy = ProxyProcess(
        "--model",
        str(tiny_gguf),
        "--threads",
        "1",
        "--ctx-size",
        "16384",
        env={"ADAPTIVE_SPEC_STATE_DIR": str(tmp_path / "state")},
    )
    try:
        out = tmp_path / "bench"
        argv = [
            sys.executable,
            "-m",
            "adaptive_spec",
            "bench",
            "--url",
            proxy.base,
            "--workload",
            "iterative",
            "--workload",
            "oneshot",
            "--adaptive",
            "--max-tokens",
            "16",
            "--repeat",
            "1",
            "--out",
            str(out),
        ]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    finally:
        proxy.stop()
    assert done.returncode == 0, done.stderr
    assert "workload: iterative" in done.stdout and "workload: oneshot" in done.stdout
    assert "attached" not in done.stderr  # launched profiles are restarted before each pass: nothing carries over
    result = json.loads((out / "bench.json").read_text())
    assert result["baseline"] == "oneshot"
    names = {(r["workload"], r["name"]) for r in result["rows"]}
    targets = ("oneshot", "iterative", "adaptive", "best static per request", "best seen per request")
    assert names == {(w, p) for w in ("iterative", "oneshot") for p in targets}
    records = result["records"]["iterative"]
    assert len(records) == 9 * 5 and all(r["outcome"] == "finished" for r in records)
    assert all(r["timings"]["predicted_n"] <= 16 for r in records)
    # The adaptive pass went where the proxy's policy sent it, and says how; the oracle took, per request, the
    # static pass that decoded it fastest; the best seen per request bounds the adaptive pass.
    adaptive = [r for r in records if r["profile"] == "adaptive"]
    assert {r["served_profile"] for r in adaptive} <= {"oneshot", "iterative"}
    assert all(r["route"] in ("estimate", "stay", "fallback") for r in adaptive)

    def speed(r: dict[str, Any]) -> float:
        return float(r["timings"]["predicted_n"]) / float(r["timings"]["predicted_ms"])

    for oracle in (r for r in records if r["profile"] == "best static per request"):
        statics = [r for r in records if r["index"] == oracle["index"] and r["profile"] in ("oneshot", "iterative")]
        assert speed(oracle) == max(speed(r) for r in statics)
        assert oracle["served_profile"] in ("oneshot", "iterative")
    for bound in (r for r in records if r["profile"] == "best seen per request"):
        mine = next(r for r in adaptive if r["index"] == bound["index"])
        assert speed(bound) >= speed(mine) * (1 - 1e-9) and bound["ttst_ms"] <= mine["ttst_ms"]
    assert "adaptive vs best static per request (not an upper bound): decode tok/s " in done.stdout
    assert "note: one round only (--repeat 1)" in done.stdout
    best_lines = [x for x in done.stdout.splitlines() if x.startswith("best static setting for this workload: ")]
    assert len(best_lines) == 2 and all(x.split(": ")[1].split(";")[0] in ("oneshot", "iterative") for x in best_lines)
    assert all("; adaptive vs it: decode tok/s " in x for x in best_lines), best_lines
    verdicts = {(v["workload"], v["against"]): v for v in result["verdicts"]}
    assert len(verdicts) == 2 * 4
    for v in verdicts.values():
        speed_ratio = v["decode_tok_s"]
        assert speed_ratio["low"] <= speed_ratio["value"] <= speed_ratio["high"]
        assert speed_ratio["verdict"] in ("faster", "slower", "indistinguishable")
    assert [(p["workload"], p["target"], p["round"]) for p in result["load"]][:3] == [
        ("iterative", "adaptive", 0),
        ("iterative", "oneshot", 0),
        ("iterative", "iterative", 0),
    ]
    assert all(p["start"]["cores"] >= 1 and "end" in p and "warning" in p for p in result["load"])
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "bench.csv").read_text().startswith("workload,name,requests")
    unknown = subprocess.run(
        [sys.executable, "-m", "adaptive_spec", "bench", "--workload", "nope.json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unknown.returncode == 2 and "not one of iterative, oneshot, mixed" in unknown.stderr
