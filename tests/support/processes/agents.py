"""What the end-to-end agent tests (tests/e2e/) share: where the installed clients are, running one, and the
proxy's records and trace report of what it did."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from adaptive_spec.errors import ModelError
from adaptive_spec.llama.models import ensure_embedded
from tests.support.processes.servers import ProxyProcess, http_json

ROOT = Path(__file__).resolve().parents[3]
AGENTS_MODEL = "embedded:qwen2.5-coder-1.5b"


def e2e_model() -> str:
    chosen = os.environ.get("ADAPTIVE_SPEC_E2E_MODEL")
    if chosen:
        return chosen
    try:
        ensure_embedded(AGENTS_MODEL.removeprefix("embedded:"))
    except ModelError:
        return "embedded:qwen2.5-coder-0.5b"
    return AGENTS_MODEL


ENABLED = os.environ.get("ADAPTIVE_SPEC_E2E") == "1"
# The two steps the agents of tests/e2e/ are given (test_agents.py has its own, on greet.py).
CREATE = "Create hello.py that prints hello."
EDIT = "Change hello.py so it prints bye."


def file_text(path: Path) -> str | None:
    """What a step left in the file (None: no file)."""
    return path.read_text() if path.is_file() else None


CLIENTS = Path(os.environ.get("ADAPTIVE_SPEC_E2E_CLIENTS") or ROOT / ".e2e-clients")


def client(name: str) -> Path:
    """The installed client's executable, or skip the test saying how to install it."""
    for folder in (CLIENTS / "npm" / "node_modules" / ".bin", CLIENTS / "venv" / "bin"):
        if (folder / name).exists():
            return folder / name
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed: run tests/e2e/install_clients.sh")
    return Path(found)


def run(
    argv: list[str | Path], cwd: Path, env: dict[str, str], timeout: float = 1800, stop_after: float | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a client to its end; `stop_after`: stop it after that many seconds instead of failing (returncode -9),
    for an agent measured as far as it gets."""
    try:
        return subprocess.run(
            [str(a) for a in argv],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=stop_after or timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        if stop_after is None:
            raise
        out, err = (x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (exc.stdout, exc.stderr))
        return subprocess.CompletedProcess(exc.cmd, -9, out, err)


def drafts_match_the_server(proxy: ProxyProcess) -> tuple[tuple[int, int], tuple[int, int]]:
    """Drafted and accepted tokens summed over every record, and llama-server's own counters (the profiles share
    one server): ((records' drafted, accepted), (server's drafted, accepted))."""
    got = http_json(proxy.base + "/adaptive/requests?limit=1000")["requests"]
    timings = [r["timings"] or {} for r in got]
    ours = (sum(t.get("draft_n", 0) for t in timings), sum(t.get("draft_n_accepted", 0) for t in timings))
    request = urllib.request.Request(proxy.base + "/metrics", headers={"x-adaptive-spec-profile": "iterative"})
    with urllib.request.urlopen(request, timeout=30) as resp:
        text = resp.read().decode()
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("llamacpp:spec_decode"))
    theirs = tuple(
        int(float(values[f"llamacpp:spec_decode_num_{name}_tokens_total"])) for name in ("draft", "accepted")
    )
    return ours, (theirs[0], theirs[1])


def records(proxy: ProxyProcess, project: str) -> list[dict[str, Any]]:
    http_json(proxy.base + "/adaptive/sessions?drain=1")
    got: list[dict[str, Any]] = http_json(proxy.base + "/adaptive/requests?limit=1000")["requests"]
    return sorted((r for r in got if r["project"] == project), key=lambda r: r["started_at_unix"])


def _first_request(gen: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The conversation's first answered request: its prompt (llama-server's count), the estimate and time to the
    first token, and how many attempts before it were given up on."""
    answered = [r for r in gen if r["status"] == 200]
    if not answered:
        return None
    first, timings = answered[0], answered[0]["timings"] or {}
    return {
        "prompt_tokens": timings.get("prompt_n", 0) + timings.get("cache_n", 0),
        "cached": timings.get("cache_n"),
        "estimate": first.get("new_tokens_est"),
        "ttft_ms": first.get("ttft_ms"),
        "attempts_before": sum(r["status"] == 499 and r["started_at_unix"] < first["started_at_unix"] for r in gen),
    }


def _followup_error(gen: list[dict[str, Any]]) -> dict[str, Any]:
    """The estimate of the new prompt tokens against llama-server's prompt_n on the answered follow-ups: median
    relative error and how many within 15%."""
    pairs = [
        (r["new_tokens_est"], (r["timings"] or {})["prompt_n"])
        for r in gen
        if r["status"] == 200 and r.get("new_tokens_est") is not None and (r["timings"] or {}).get("cache_n")
        if (r["timings"] or {}).get("prompt_n")
    ]
    errors = sorted(abs(e - t) / t for e, t in pairs)
    return {
        "turns": len(pairs),
        "median": round(errors[len(errors) // 2], 3) if errors else None,
        "within_15": sum(e <= 0.15 for e in errors),
    }


# The record's APIs that generate (Gemini's is translated into chat completions, and recorded as "gemini").
GENERATING = ("chat", "responses", "completions", "messages", "gemini")
# The proxy's estimate of a follow-up turn's prefill against llama-server's prompt_n: the session's median within 15%,
# and no turn off by more than half (or 64 tokens, for turns of a few dozen where the template's markers dominate) --
# a whole prompt estimated again, as before the billing value was normalised, is off by thousands. A request right
# after a cancelled one is left out: llama-server's slot holds the cancelled prompt, the proxy the one before it.
MEDIAN_ERROR = 0.15
TURN_ERROR, TURN_SLACK_TOKENS = 0.5, 64
# A first turn (nothing of it cached: at most llama-server's few re-read tokens) is estimated within this.
FIRST_TURN_ERROR, COLD_CACHED_TOKENS = 0.15, 16


def estimates_off(recs: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(estimate, prompt_n) of the main-line follow-ups that break the bounds above, and (-1, -1) if the median
    does."""
    pairs, after_cancel = [], False
    for r in sorted(recs, key=lambda r: r["started_at_unix"]):
        timings = r.get("timings") or {}
        est, true = r.get("new_tokens_est"), timings.get("prompt_n")
        if not (r.get("side") or est is None or not true or not timings.get("cache_n") or after_cancel):
            pairs.append((est, true))
        after_cancel = r["status"] == 499
    off = [(e, t) for e, t in pairs if abs(e - t) > max(TURN_ERROR * t, TURN_SLACK_TOKENS)]
    if pairs and statistics.median(abs(e - t) / t for e, t in pairs) > MEDIAN_ERROR:
        off.append((-1, -1))  # the median is off
    return off


def first_turns_off(recs: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(estimate, prompt_n) of the answered requests prefilled cold (a conversation's first turn, a side request's
    own prompt) whose estimate is off by more than 15%."""
    cold = [
        (r["new_tokens_est"], (r["timings"] or {})["prompt_n"])
        for r in recs
        if r["status"] == 200 and r.get("new_tokens_est") is not None and (r["timings"] or {}).get("prompt_n")
        if (r["timings"] or {}).get("cache_n", 0) <= COLD_CACHED_TOKENS
    ]
    return [(e, t) for e, t in cold if abs(e - t) > FIRST_TURN_ERROR * t]


def summary(
    agent: str, recs: list[dict[str, Any]], expected_sessions: int, done: list[Any], notes: str = ""
) -> dict[str, Any]:
    """What the closing note needs, per agent; written to ADAPTIVE_SPEC_E2E_OUT."""
    gen = [r for r in recs if r["api"] in GENERATING]
    out = {
        "agent": agent,
        "requests": len(recs),
        "statuses": sorted({r["status"] for r in recs}),
        "apis": sorted({r["api"] for r in recs}),
        "sessions_found": len({r["session_id"] for r in gen}),
        "sessions_expected": expected_sessions,
        "side_requests": sum(bool(r.get("side")) for r in gen),
        "projects": sorted({r["project"] for r in recs}),
        "profiles": [r["profile"] for r in gen],
        "reasons": [r.get("reason") for r in gen],
        "drafted": sum((r["timings"] or {}).get("draft_n", 0) for r in gen),
        "accepted": sum((r["timings"] or {}).get("draft_n_accepted", 0) for r in gen),
        "new_tokens": [{"est": r.get("new_tokens_est"), "true": (r["timings"] or {}).get("prompt_n")} for r in gen],
        "first_request": _first_request(gen),
        "first_turns_off": first_turns_off(gen),
        "followup_error": _followup_error(gen),
        "client_exit": [getattr(d, "returncode", None) for d in done],
        "notes": notes,
    }
    folder = Path(os.environ.get("ADAPTIVE_SPEC_E2E_OUT") or ROOT / "benchmarks" / "results" / "e2e")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{agent}.json").write_text(json.dumps(out, indent=1))
    return out


def check_trace_report(proxy: ProxyProcess, tmp_path: Path) -> str:
    """`adaptive-spec report` on the trace: its moves column adds up."""
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "adaptive_spec", "report", str(proxy.trace)],  # type: ignore[attr-defined]
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    rows = [line.split("|") for line in done.stdout.splitlines()[2:] if line.startswith("|")]
    moves = {cells[1].strip(): int(cells[11].strip()) for cells in rows}
    total = moves.pop("all (as routed)")
    assert sum(moves.values()) == total
    return str(done.stdout)
