from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest

from adaptive_spec.telemetry.bus import EventBus
from adaptive_spec.telemetry.events import EventsDropped, ProfileDown, ProfileUp
from adaptive_spec.telemetry.records import RequestRecord
from adaptive_spec.telemetry.trace import TraceWriter


@pytest.mark.asyncio(loop_scope="function")
async def test_slow_subscriber_loses_the_oldest_and_is_told_how_many() -> None:
    bus = EventBus(queue_limit=3)
    slow, fast = bus.subscribe(), bus.subscribe()
    seen: list[str] = []
    bus.listen(lambda e: seen.append(type(e).__name__))
    for i in range(5):
        bus.publish(ProfileUp(profile=f"p{i}", base_url="u"))
    batch = await asyncio.wait_for(slow.next_batch(), 1)
    assert isinstance(batch[0], EventsDropped) and batch[0].count == 2
    assert [e.profile for e in batch[1:] if isinstance(e, ProfileUp)] == ["p2", "p3", "p4"]
    assert len(seen) == 5
    bus.publish(ProfileDown(profile="p0", base_url="u", reason="exited"))
    batch = await asyncio.wait_for(fast.next_batch(), 1)
    assert [type(e).__name__ for e in batch] == ["EventsDropped", "ProfileUp", "ProfileUp", "ProfileDown"]
    assert isinstance(batch[0], EventsDropped) and batch[0].count == 3
    assert [type(e).__name__ for e in await asyncio.wait_for(slow.next_batch(), 1)] == ["ProfileDown"]


@pytest.mark.asyncio(loop_scope="function")
async def test_closing_ends_waiting_feeds() -> None:
    bus = EventBus()
    sub = bus.subscribe()
    waiter = asyncio.create_task(sub.next_batch())
    await asyncio.sleep(0)
    bus.close_all()
    assert await asyncio.wait_for(waiter, 1) == []
    assert bus.subscribers == 0


def test_a_failing_listener_does_not_stop_the_others() -> None:
    bus = EventBus()
    got: list[object] = []

    def broken(_: object) -> None:
        raise RuntimeError("boom")

    bus.listen(broken)
    bus.listen(got.append)
    bus.publish(ProfileUp(profile="p", base_url="u"))
    assert len(got) == 1


def test_trace_rotates_by_size_and_keeps_three(tmp_path: Path) -> None:
    trace = TraceWriter(tmp_path / "t.jsonl", max_bytes=200, keep=3)
    for i in range(40):
        trace.request({"request_id": str(i), "profile": "p"}, b'{"messages": []}', None)
    trace.close()
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["t.jsonl", "t.jsonl.1", "t.jsonl.2", "t.jsonl.3"]
    line = orjson.loads((tmp_path / "t.jsonl.1").read_text().splitlines()[0])
    assert line["kind"] == "request" and "request_body" not in line and len(line["request_sha256"]) == 64


def test_trace_keeps_content_only_when_asked(tmp_path: Path) -> None:
    trace = TraceWriter(tmp_path / "t.jsonl", content=True)
    trace.request({"request_id": "1"}, b'{"messages": [{"role": "user", "content": "secret"}]}', "reply")
    trace.close()
    line = orjson.loads((tmp_path / "t.jsonl").read_text())
    assert line["request_body"]["messages"][0]["content"] == "secret" and line["output_text"] == "reply"


def test_trace_survives_its_file_being_moved_away(tmp_path: Path) -> None:
    trace = TraceWriter(tmp_path / "t.jsonl", max_bytes=100, keep=2)
    trace.request({"request_id": "a"}, b"{}", None)
    (tmp_path / "t.jsonl").rename(tmp_path / "elsewhere.jsonl")
    for i in range(5):
        trace.request({"request_id": str(i)}, b"{}", None)
    trace.close()

    def ids(name: str) -> list[str]:
        return [orjson.loads(line)["request_id"] for line in (tmp_path / name).read_text().splitlines()]

    # Every line is over max_bytes, so each write rotates: after the move the writer reopened its own path, rotated
    # on, and keeps the newest lines where they belong (keep=2: two rotated parts, no third).
    assert (ids("t.jsonl.1"), ids("t.jsonl.2"), ids("t.jsonl")) == (["4"], ["3"], [])
    assert not (tmp_path / "t.jsonl.3").exists()


def test_metric_labels_stay_bounded() -> None:
    from adaptive_spec.telemetry.events import RequestFailed, RequestFinished
    from adaptive_spec.telemetry.metrics import MAX_PROJECT_LABELS, ProxyMetrics

    metrics = ProxyMetrics(frozenset({"oneshot"}))
    record = {"profile": "made-up", "project": "p", "api": "chat", "status": 400, "timings": None, "ttft_ms": None}
    metrics.on_event(RequestFailed(record=record))
    for i in range(MAX_PROJECT_LABELS + 5):
        metrics.on_event(RequestFinished(record={**record, "profile": "oneshot", "project": f"proj{i}", "status": 200}))
    text = metrics.render().decode()
    assert 'profile="unknown"' in text and "made-up" not in text
    assert 'project="other"' in text and f'project="proj{MAX_PROJECT_LABELS + 3}"' not in text


def test_history_limit_zero_is_empty() -> None:
    from adaptive_spec.telemetry.history import RequestHistory

    history = RequestHistory(5)
    records = [_record(str(i)) for i in range(3)]
    for record in records:
        history.add(record)
    assert history.latest(0) == []
    assert history.latest(None) == records and history.latest(-1) == records
    assert history.latest(2) == records[1:]


def _record(request_id: str) -> RequestRecord:
    return RequestRecord(
        request_id=request_id,
        started_at_unix=0.0,
        method="POST",
        path="/v1/chat/completions",
        api="chat",
        project="default",
        session_id=None,
        session_source=None,
        subagent=False,
        profile="p",
        stream=False,
        status=200,
        outcome="finished",
        error=None,
        timings=None,
        ttft_ms=None,
        ttst_ms=None,
        total_ms=1.0,
    )


def test_a_trace_that_cannot_be_written_drops_lines_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    trace = TraceWriter(Path("/dev/full"))  # every write: "No space left on device"
    for n in range(5):
        trace.write({"kind": "request", "n": n})
    assert (trace.dropped, trace.dropped_total) == (5, 5)
    errors = [r for r in caplog.records if "cannot write /dev/full" in r.getMessage()]
    assert len(errors) == 1 and "No space left on device" in errors[0].getMessage()
    trace.close()


def test_a_trace_line_cut_off_by_a_full_disk_does_not_spoil_the_next(tmp_path: Path) -> None:
    trace = TraceWriter(tmp_path / "t.jsonl")
    trace.write({"n": 1})
    real = trace._file
    writes: list[bytes] = []

    class HalfFull:  # writes 5 bytes, then the disk is full
        def write(self, data: memoryview) -> int:
            if writes:
                raise OSError(28, "No space left on device")
            writes.append(bytes(data[:5]))
            return real.write(data[:5]) or 0

        def tell(self) -> int:
            return real.tell()

    trace._file = HalfFull()  # type: ignore[assignment]
    trace.write({"n": 2})
    trace._file = real
    trace.write({"n": 3})
    trace.close()
    lines = (tmp_path / "t.jsonl").read_bytes().split(b"\n")
    assert lines[0] == b'{"n":1}' and lines[1] == b'{"n":' and lines[2] == b'{"n":3}', lines
    assert trace.dropped == 0 and trace.dropped_total == 1


def test_remote_prefills_are_counted_by_outcome_and_timed_by_step() -> None:
    from adaptive_spec.telemetry.events import RemotePrefillDone
    from adaptive_spec.telemetry.metrics import ProxyMetrics

    metrics = ProxyMetrics(frozenset({"main"}))
    common: dict[str, Any] = {"session_id": "s", "profile": "main", "relay": "http://pp:8095", "save_s": 0.02}
    metrics.on_event(
        RemotePrefillDone(
            **common,
            ok=True,
            reason=None,
            tokens=4000,
            bytes=3 << 20,
            remote_prefill_s=0.4,
            transfer_s=2.0,
            restore_s=0.1,
            error=None,
        )
    )
    for reason in ("timeout", "checksum", "timeout"):
        metrics.on_event(
            RemotePrefillDone(
                **common,
                ok=False,
                reason=reason,
                tokens=0,
                bytes=0,
                remote_prefill_s=0.0,
                transfer_s=0.0,
                restore_s=0.0,
                error="x",
            )
        )
    text = metrics.render().decode()
    assert "adaptive_spec_remote_prefill_chosen_total 4.0" in text
    assert "adaptive_spec_remote_prefill_done_total 1.0" in text
    assert 'adaptive_spec_remote_prefill_fallbacks_total{reason="timeout"} 2.0' in text
    assert 'adaptive_spec_remote_prefill_fallbacks_total{reason="checksum"} 1.0' in text
    assert 'adaptive_spec_remote_prefill_seconds_bucket{le="2.5",step="transfer"} 1.0' in text
    assert 'adaptive_spec_remote_prefill_seconds_bucket{le="1.0",step="transfer"} 0.0' in text
    assert 'adaptive_spec_remote_prefill_transfer_bytes_bucket{le="4.194304e+06"} 1.0' in text
    assert "adaptive_spec_remote_prefill_transfer_bytes_count 1.0" in text


def test_a_record_as_json_is_what_asdict_makes() -> None:
    from dataclasses import asdict, replace

    from adaptive_spec.telemetry.records import Timings

    for record in (
        _record("r1"),
        replace(
            _record("r2"),
            timings=Timings(prompt_n=5, cache_n=3, predicted_n=7, draft_n=4, draft_n_accepted=2),
            handoff={"ok": True, "tokens": 12},
            route="estimate",
            replica_moved_from=1,
        ),
    ):
        assert record.to_json() == asdict(record)
        assert orjson.dumps(record.to_json()) == orjson.dumps(asdict(record))
