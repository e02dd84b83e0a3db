"""`adaptive-spec bench` against a REAL launched proxy (tiny model): every target runs, outputs are written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.servers import ProxyProcess


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
    targets = ("oneshot", "iterative", "adaptive", "oracle")
    assert names == {(w, p) for w in ("iterative", "oneshot") for p in targets}
    records = result["records"]["iterative"]
    assert len(records) == 9 * 4 and all(r["outcome"] == "finished" for r in records)
    assert all(r["timings"]["predicted_n"] <= 16 for r in records)
    # The adaptive pass went where the proxy's policy sent it, and says how; the oracle took, per request, the
    # static pass that decoded it fastest.
    adaptive = [r for r in records if r["profile"] == "adaptive"]
    assert {r["served_profile"] for r in adaptive} <= {"oneshot", "iterative"}
    assert all(r["route"] in ("estimate", "stay", "fallback") for r in adaptive)

    def speed(r: dict[str, Any]) -> float:
        return float(r["timings"]["predicted_n"]) / float(r["timings"]["predicted_ms"])

    for oracle in (r for r in records if r["profile"] == "oracle"):
        statics = [r for r in records if r["index"] == oracle["index"] and r["profile"] in ("oneshot", "iterative")]
        assert speed(oracle) == max(speed(r) for r in statics)
        assert oracle["served_profile"] in ("oneshot", "iterative")
    assert "× the oracle's throughput" in done.stdout
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "bench.csv").read_text().startswith("workload,name,requests")
    unknown = subprocess.run(
        [sys.executable, "-m", "adaptive_spec", "bench", "--workload", "nope.json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unknown.returncode == 2 and "not one of iterative, oneshot, mixed" in unknown.stderr
