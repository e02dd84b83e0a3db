"""The live event feed, per-token timings kept from clients that did not ask, metrics and trace, on a REAL server."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.support.processes.servers import LlamaServer, ProxyProcess, http_text, wait_until
from tests.support.sse import events, stream_events


@pytest.fixture(scope="module")
def traced(tiny_server: LlamaServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ProxyProcess, Path]]:
    trace = tmp_path_factory.mktemp("trace") / "trace.jsonl"
    proc = ProxyProcess("--profile", f"plain={tiny_server.url}", "--trace", str(trace))
    yield proc, trace
    proc.stop()


class Feed:
    """Reads /adaptive/events in a thread, collecting (event, data) pairs."""

    def __init__(self, url: str) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self._resp = urllib.request.urlopen(url, timeout=60)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for event in stream_events(self._resp):
                self.events.append((event.event, json.loads(event.data)))
        except (OSError, ValueError, AttributeError):  # closed under the reader by close()
            return

    def close(self) -> None:
        self._resp.close()


def _post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_event_feed_tells_the_story_of_each_request(traced: tuple[ProxyProcess, Path]) -> None:
    proxy, _ = traced
    feed = Feed(proxy.base + "/adaptive/events")
    try:
        wait_until(lambda: bool(feed.events), 10, "the snapshot")
        kind, snapshot = feed.events[0]
        assert kind == "snapshot"
        assert snapshot["profiles"][0]["name"] == "plain" and snapshot["profiles"][0]["up"] is True
        body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 3000, "ignore_eos": True, "stream": True}
        status, raw = _post(proxy.base + "/v1/chat/completions", body)
        assert status == 200
        bad_status, _ = _post(proxy.base + "/v1/chat/completions", {"messages": "oops"})
        assert bad_status == 400
        wait_until(lambda: sum(k in ("RequestFinished", "RequestFailed") for k, _ in feed.events) >= 2, 10, "events")
    finally:
        feed.close()
    by_request: dict[str, list[str]] = {}
    lifecycle = ("RequestStarted", "DraftProgress", "RequestFinished", "RequestFailed")
    for kind, data in feed.events[1:]:
        if kind == "SessionUpdated":  # the session's statistics, folded in after the request's own story
            continue
        rid = data.get("request_id") or data.get("record", {}).get("request_id")
        if rid and kind in lifecycle:  # a SessionUpdated for the request may follow its end (the worker's, later)
            by_request.setdefault(rid, []).append(kind)
    stories = list(by_request.values())
    good = next(s for s in stories if "RequestFinished" in s)
    assert good[0] == "RequestStarted" and good[-1] == "RequestFinished" and "DraftProgress" in good
    assert good.count("RequestFinished") == 1 and "RequestFailed" not in good
    bad = next(s for s in stories if "RequestFailed" in s)
    assert bad == ["RequestStarted", "RequestFailed"]
    # The client never asked for per-token timings: only the final chunk carries them.
    chunks = [e.data for e in events(raw) if e.data.startswith("{")]
    with_timings = [c for c in chunks if '"timings"' in c]
    assert len(chunks) > 100 and len(with_timings) == 1 and '"finish_reason":"length"' in with_timings[0]


def test_metrics_and_trace_match_the_records(traced: tuple[ProxyProcess, Path]) -> None:
    proxy, trace = traced
    status, _ = _post(proxy.base + "/p/metered/v1/completions", {"prompt": "def f(", "max_tokens": 7})
    assert status == 200
    metrics = http_text(proxy.base + "/metrics")
    assert 'adaptive_spec_predicted_tokens_total{profile="plain",project="metered"} 7.0' in metrics
    assert (
        'adaptive_spec_requests_total{api="completions",outcome="finished",profile="plain",project="metered"} 1.0'
        in metrics
    )
    assert 'adaptive_spec_profile_up{profile="plain"} 1.0' in metrics
    lines = [orjson.loads(line) for line in trace.read_text().splitlines()]
    assert lines[0]["kind"] == "profiles" and lines[0]["profiles"][0]["name"] == "plain"
    last = lines[-1]
    assert last["kind"] == "request" and last["project"] == "metered" and last["timings"]["predicted_n"] == 7
    assert "request_body" not in last and len(last["request_sha256"]) == 64


def test_report_from_the_trace(traced: tuple[ProxyProcess, Path], tmp_path: Path) -> None:
    import subprocess
    import sys

    proxy, trace = traced
    _post(proxy.base + "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5})
    out = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "-m", "adaptive_spec", "report", str(trace), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].startswith("| profile | requests |")
    assert "| plain |" in done.stdout and "| all (as routed) |" in done.stdout
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "report.csv").read_text().startswith("name,requests")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind": "request"}\nnot json\n')
    failed = subprocess.run([sys.executable, "-m", "adaptive_spec", "report", str(bad)], capture_output=True, text=True)
    assert failed.returncode != 0 and f"{bad}:2: not a JSON line" in failed.stderr


def test_a_responses_stream_gets_live_draft_progress(traced: tuple[ProxyProcess, Path]) -> None:
    proxy, _ = traced
    feed = Feed(proxy.base + "/adaptive/events")
    try:
        wait_until(lambda: bool(feed.events), 10, "the snapshot")
        body = {"input": "go", "max_output_tokens": 3000, "ignore_eos": True, "stream": True}
        status, raw = _post(proxy.base + "/v1/responses", body)
        assert status == 200
        wait_until(lambda: any(k == "RequestFinished" for k, _ in feed.events), 10, "the end")
    finally:
        feed.close()
    finished = next(d["record"] for k, d in feed.events if k == "RequestFinished")
    assert finished["api"] == "responses"
    total = finished["timings"]["predicted_n"]
    progress = [
        d["predicted_n"] for k, d in feed.events if k == "DraftProgress" and d["request_id"] == finished["request_id"]
    ]
    # Live: published while the answer was still being generated, not only once at its end.
    assert progress and min(progress) < total
    # The client never asked for per-token timings: only the response.completed event carries them.
    objects = [e for e in events(raw) if e.data.startswith("{")]
    with_timings = [e for e in objects if '"timings"' in e.data]
    assert len(objects) > 100 and len(with_timings) == 1 and with_timings[0].event == "response.completed"


def test_a_responses_stream_dropped_by_the_client_keeps_its_timings(traced: tuple[ProxyProcess, Path]) -> None:
    """While a live view watches, the proxy asks for per-token timings: a stream the client drops still has them."""
    proxy, _ = traced
    body = {"input": "go", "max_output_tokens": 30000, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(proxy.base + "/v1/responses", data=json.dumps(body).encode())
    feed = Feed(proxy.base + "/adaptive/events")
    try:
        wait_until(lambda: bool(feed.events), 10, "the snapshot")
        with urllib.request.urlopen(req, timeout=60) as resp:
            deltas, deadline = 0, time.monotonic() + 60
            for event in stream_events(resp):  # to the stream's end at the latest: it is 30000 tokens long
                deltas += event.event == "response.output_text.delta"
                if deltas >= 20:
                    break
                assert time.monotonic() < deadline, "20 text deltas did not come within 60 s"
            assert deltas >= 20, "the stream ended before 20 text deltas"
            request_id = resp.headers["x-adaptive-spec-request-id"]
    finally:
        feed.close()

    def record() -> dict[str, Any] | None:
        records = json.loads(http_text(proxy.base + "/adaptive/requests"))["requests"]
        return next((r for r in records if r["request_id"] == request_id), None)

    wait_until(lambda: record() is not None, 10, "the dropped request's record")
    dropped = record()
    assert dropped is not None and dropped["status"] == 499 and dropped["outcome"] == "failed"
    # The timings of the last event the proxy parsed: per-token timings can trail the text deltas by a few events.
    assert dropped["timings"] is not None and dropped["timings"]["predicted_n"] >= 10


def test_the_feed_snapshot_lists_requests_in_flight(traced: tuple[ProxyProcess, Path]) -> None:
    proxy, _ = traced
    body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 30000, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(proxy.base + "/p/live/v1/chat/completions", data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.read1(1024)  # answering (and, unread, held back by the client's own pace)
        request_id = resp.headers["x-adaptive-spec-request-id"]
        feed = Feed(proxy.base + "/adaptive/events")
        try:
            wait_until(lambda: bool(feed.events), 10, "the snapshot")
        finally:
            feed.close()
    kind, snapshot = feed.events[0]
    assert kind == "snapshot"
    live = [r for r in snapshot["in_flight"] if r["request_id"] == request_id]
    assert len(live) == 1 and live[0]["project"] == "live" and live[0]["api"] == "chat" and live[0]["stream"] is True
