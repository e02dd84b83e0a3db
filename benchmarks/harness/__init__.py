"""What every benchmark shares: where the repository and the results folder are, the result file every script
writes (`results.write`), one percentile (`stats`), and the agent-shaped bodies (`agent_bodies`).

Benchmarks run as modules from the repository root (`python -m benchmarks.<claim>.<script>`), so `benchmarks.*`,
`tests.support.*` and `adaptive_spec` import without editing `sys.path`.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
