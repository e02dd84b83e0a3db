"""Time estimates true from the first request, on the real Qwen2.5-Coder-0.5B behind `adaptive-spec serve` as a user
runs it: a fresh `serve` measures its launched server once in the background (the proxy's own request, recorded as
such), keeps the speed model in the state folder under the server's identity, and a restarted `serve` loads it
instead of measuring again; a route's reason says which it used; every record keeps its estimated and measured
prefill and decode seconds; and remote prefill is decided on the local server's measured rate."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.support.processes.relay import RelayProcess
from tests.support.processes.servers import LlamaServer, ProxyProcess, chat_record, http_json, wait_until

MEASURED = "speeds: measured on"
KEPT = "speeds: measured before"
MESSAGES = [
    {"role": "system", "content": "You are a careful coding assistant. Answer with code only."},
    {"role": "user", "content": "Write a Python function that returns the n-th Fibonacci number."},
]


def _serve(state: Path) -> ProxyProcess:
    return ProxyProcess("--threads", "1", "--ctx-size", "8192", env={"ADAPTIVE_SPEC_STATE_DIR": str(state)})


def _line(proxy: ProxyProcess, start: str) -> str:
    found: list[str] = []

    def said() -> bool:
        found[:] = [line for line in proxy.stdout_lines + proxy.stderr_lines if line.startswith(start)]
        return bool(found)

    wait_until(said, 300, f"a line starting {start!r}")
    return found[0]


@pytest.fixture
def state(qwen_gguf: Path, tmp_path: Path) -> Path:  # qwen_gguf: serve's default model, assembled
    return tmp_path / "state"


def test_a_fresh_serve_measures_once_and_a_restarted_one_loads_what_it_kept(state: Path) -> None:
    proxy = _serve(state)
    try:
        # Sent at once: it waits for the measurement (it would queue behind it anyway) and is routed on its figures.
        record = chat_record(proxy, MESSAGES, 32)  # decode long enough to judge (MIN_MEASURED_S)
        said = _line(proxy, MEASURED)
        assert "prefill" in said and "tok/s" in said, said
        own = [r for r in proxy.requests() if r["own"] is not None]
        assert len(own) == 1, own
        (measurement,) = own
        assert measurement["own"] == "speed measurement" and measurement["client"] == "adaptive-spec"
        assert measurement["outcome"] == "finished" and measurement["session_id"] is None
        assert measurement["timings"]["prompt_n"] >= 64 and measurement["timings"]["predicted_n"] >= 32
        assert measurement["started_at_unix"] < record["started_at_unix"] + record["total_ms"] / 1000
        assert "(measured)" in str(record["reason"]) and "(prior)" not in str(record["reason"]), record["reason"]
        estimate, timings = record["time_estimate"], record["timings"]
        assert estimate["basis"] == "measured" and estimate["prefill_s_est"] > 0 and estimate["decode_s_est"] > 0
        assert estimate["prefill_s"] == pytest.approx(timings["prompt_ms"] / 1000, abs=1e-3)
        assert estimate["decode_s"] == pytest.approx(timings["predicted_ms"] / 1000, abs=1e-3)
        assert estimate["decode_error"] == pytest.approx(estimate["decode_s_est"] / estimate["decode_s"] - 1, abs=1e-3)
        shown = http_json(proxy.base + "/adaptive/requests")["time_estimates"]
        assert shown["measured"]["decode"]["n"] == 1, shown  # the proxy's own request is not judged
    finally:
        proxy.stop()
    (kept,) = (state / "speeds").glob("*.json")
    snapshot = json.loads(kept.read_text())["speeds"]
    assert snapshot["measured_prefill_s"] > 0 and snapshot["measured_decode_s"] > 0

    proxy = _serve(state)
    try:
        assert str(kept) in _line(proxy, KEPT)
        record = chat_record(proxy, MESSAGES, 32)  # decode long enough to judge (MIN_MEASURED_S)
        assert "(measured)" in str(record["reason"]), record["reason"]
        assert not [r for r in proxy.requests() if r["own"] is not None]  # nothing measured again
        assert not any(line.startswith(MEASURED) for line in proxy.stdout_lines + proxy.stderr_lines)
    finally:
        proxy.stop()


RELAY_KEY = "time-estimates-relay-key"
LOG = "Here is the log:\n" + "\n".join(f"line {i}: value={i * 7 % 13} status=ok" for i in range(300)) + "\nSum up."


def test_remote_prefill_is_decided_on_the_local_servers_measured_rate(
    llama_server_binary: str, qwen_gguf: Path, tmp_path: Path
) -> None:
    """Two real servers with the real 0.5B: the remote one beside its kv-relay, and the local one `serve` launches,
    slowed (`-ub 16`: small batches). Measured at start, the local rate sends a long first prompt remote; the old
    prior (400 tok/s, one cost a token) would have kept it here. A short prompt stays here."""
    remote_slots = tmp_path / "remote-slots"
    remote_slots.mkdir()
    args = ("-c", "8192", "--parallel", "1", "--spec-type", "none", "--slot-save-path", str(remote_slots))
    remote = LlamaServer(llama_server_binary, qwen_gguf, *args, log_dir=tmp_path / "logs")
    relay = RelayProcess(remote_slots, qwen_gguf, RELAY_KEY, server=remote.url)
    (tmp_path / "relay.key").write_text(RELAY_KEY + "\n")
    # Between the old prior (400 tok/s: it kept the prompt local) and the slowed local server's measured rate
    # (~140-250 tok/s here): sending it is worth it on the measured rate only. (The remote really does ~100.)
    remote_tps = 350.0
    proxy = ProxyProcess(
        *("--threads", "1", "--ctx-size", "8192", "--server-arg=-ub", "--server-arg=16"),
        *("--pp-server", relay.base, "--pp-key-file", str(tmp_path / "relay.key"), "--pp-prefill-tps", str(remote_tps)),
        env={"ADAPTIVE_SPEC_STATE_DIR": str(tmp_path / "state")},
    )
    try:
        record = chat_record(proxy, [{"role": "user", "content": LOG}], 8, **{"x-session-id": "long"})
        reason = str(record["reason"])
        assert record["remote_prefill"] is not None and record["remote_prefill"]["ok"], (reason, proxy.log()[-3000:])
        assert "(measured)" in reason and "remote prefill of" in reason, reason
        remote_s = float(re.search(r"vs remote ([\d,.]+) s", reason).group(1).replace(",", ""))  # type: ignore[union-attr]
        old_local_s = record["new_tokens_est"] / 400.0
        assert old_local_s < remote_s * 1.25, reason  # the old estimate: not worth sending (25% margin)
        short = chat_record(proxy, [{"role": "user", "content": "Name three sorting algorithms."}], 8)
        assert short["remote_prefill"] is None and "remote" not in str(short["reason"]), short["reason"]
    finally:
        proxy.stop()
        relay.stop()
        remote.stop()
