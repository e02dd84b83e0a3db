"""`adaptive-spec bench` against a REAL launched proxy (tiny model): every target runs, outputs are written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.servers import ProxyProcess


def test_bench_runs_every_target_and_writes_its_outputs(
    tiny_gguf: Path, tmp_path: Path, llama_server_binary: str
) -> None:
    proxy = ProxyProcess("--model", str(tiny_gguf), "--threads", "1", "--ctx-size", "16384",
                         env={"ADAPTIVE_SPEC_STATE_DIR": str(tmp_path / "state")})  # fmt: skip
    try:
        out = tmp_path / "bench"
        argv = [sys.executable, "-m", "adaptive_spec", "bench", "--url", proxy.base, "--workload", "iterative",
                "--workload", "oneshot", "--adaptive", "--max-tokens", "16", "--out", str(out)]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    finally:
        proxy.stop()
    assert done.returncode == 0, done.stderr
    assert "workload: iterative" in done.stdout and "workload: oneshot" in done.stdout
    result = json.loads((out / "bench.json").read_text())
    assert result["baseline"] == "oneshot"
    names = {(r["workload"], r["name"]) for r in result["rows"]}
    assert names == {(w, p) for w in ("iterative", "oneshot") for p in ("oneshot", "iterative", "adaptive")}
    records = result["records"]["iterative"]
    assert len(records) == 9 * 3 and all(r["outcome"] == "finished" for r in records)
    assert all(r["timings"]["predicted_n"] <= 16 for r in records)
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "bench.csv").read_text().startswith("workload,name,requests")
    unknown = subprocess.run([sys.executable, "-m", "adaptive_spec", "bench", "--workload", "nope.json"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert unknown.returncode == 2 and "not one of iterative, oneshot, mixed" in unknown.stderr
