"""The speed model's identity (what makes a kept measurement true), its file, and the request path's bounded wait
for the measurements at start (requests/measured_speeds.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import web

from adaptive_spec.requests import measured_speeds
from adaptive_spec.requests.app_keys import MEASURING


def _argv(binary: Path, model: Path, port: str, *extra: str) -> list[str]:
    return [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", port, "-t", "1", *extra]


def test_the_identity_is_the_build_model_arguments_and_machine_not_the_run(tmp_path: Path) -> None:
    binary, model = tmp_path / "llama-server", tmp_path / "m.gguf"
    binary.write_bytes(b"build 1")
    model.write_bytes(b"weights")
    one = measured_speeds.identity({"http://a": _argv(binary, model, "1111", "--slot-save-path", "/run/1")}, "box")
    same = measured_speeds.identity({"http://b": _argv(binary, model, "2222", "--slot-save-path", "/run/2")}, "box")
    assert one == same  # another port, another run folder: the same speeds
    assert measured_speeds.identity({"http://a": _argv(binary, model, "1111", "-c", "8192")}, "box") != one
    assert measured_speeds.identity({"http://a": _argv(binary, model, "1111")}, "other box") != one
    model.write_bytes(b"other weights")  # replaced at the same path
    assert measured_speeds.identity({"http://a": _argv(binary, model, "1111", "--slot-save-path", "x")}, "box") != one


def test_a_kept_snapshot_reads_back_and_a_damaged_one_is_measured_again(tmp_path: Path) -> None:
    path = tmp_path / "speeds" / "abc.json"
    assert measured_speeds.read(path) is None
    measured_speeds.write(path, {"version": 1, "measured_prefill_s": 0.01})
    assert measured_speeds.read(path) == {"version": 1, "measured_prefill_s": 0.01}
    path.write_text("{not json")
    assert measured_speeds.read(path) is None


@pytest.mark.asyncio(loop_scope="function")
async def test_a_request_waits_for_a_measurement_under_way_but_not_forever(monkeypatch: pytest.MonkeyPatch) -> None:
    app = web.Application()
    await measured_speeds.measured(app)  # nothing measured: no wait
    hung = asyncio.get_running_loop().create_future()
    app[MEASURING] = {"http://a": asyncio.ensure_future(hung)}
    monkeypatch.setattr(measured_speeds, "ROUTE_WAIT_S", 0.05)
    await asyncio.wait_for(measured_speeds.measured(app), 5)
    assert not app[MEASURING]["http://a"].cancelled()  # the request's wait ends; the measurement goes on
    app[MEASURING]["http://a"].cancel()
