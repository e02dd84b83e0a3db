"""The head store's faults, tried on real processes (`serve` on the tiny model, its own llama-server): `serve` killed
with SIGKILL in the middle of its saves, the index lost with the heads still there, a second `serve` on the same state
folder, and a real full filesystem (a sized tmpfs). After each, `serve` starts, answers every request, restores
nothing wrong (a warm answer equals the cold one) and keeps what is sound."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.processes.servers import ProxyProcess, chat_record, http_json, llama_children, pid_alive, wait_until

SYSTEM = "You are a coding agent. Rules:\n" + "\n".join(
    f"{i}. Keep function_{i} small, typed and tested; never edit file_{i}.py without reading it." for i in range(40)
)


def _messages(team: int, rules: int = 40) -> list[dict[str, str]]:
    system = "\n".join(SYSTEM.replace("Rules:", f"Rules of team {team}:").splitlines()[: rules + 1])
    return [{"role": "system", "content": system}, {"role": "user", "content": "Write hello.py."}]


def _serve(tiny_gguf: Path, state: Path, *extra: str) -> ProxyProcess:
    env = {"ADAPTIVE_SPEC_STATE_DIR": str(state), "ADAPTIVE_SPEC_CONFIG_DIR": str(state.parent / "config")}
    args = ("--model", str(tiny_gguf), "--threads", "1", "--ctx-size", "8192", "--parallel", "1", *extra)
    return ProxyProcess(*args, env=env)


def _kill(proxy: ProxyProcess) -> None:
    children = list(llama_children(proxy))
    proxy.proc.send_signal(signal.SIGKILL)
    proxy.proc.wait(30)
    for pid in children:  # a killed serve cannot stop its llama-server: the test does
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def _sound(proxy: ProxyProcess, heads_dir: Path) -> list[dict[str, object]]:
    """The heads `serve` lists, each a whole file on disk of the size it says; nothing else left in the folder."""
    listed = http_json(proxy.base + "/adaptive/heads")["heads"]
    on_disk = {p.stem: p.stat().st_size for p in heads_dir.glob("*.head")}
    assert {str(h["id"]): int(str(h["bytes"])) for h in listed} == on_disk, (listed, on_disk)
    assert not list(heads_dir.glob(".*.tmp"))
    return list(listed)


def _warm_equals_cold(proxy: ProxyProcess, team: int, cold_text: str, session: str) -> None:
    warm = chat_record(proxy, _messages(team), 4, **{"x-session-id": session})
    assert warm["status"] == 200 and warm["text"] == cold_text, warm


def test_serve_killed_in_its_saves_starts_again_keeping_only_whole_heads(tiny_gguf: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    heads_dir = state / "heads"
    cold: dict[int, str] = {}
    for round_, delay in enumerate((0.0, 0.005, 0.02, 0.08)):  # SIGKILL right after an answer: in its save, or near
        proxy = _serve(tiny_gguf, state)
        try:
            record = chat_record(proxy, _messages(round_), 4, **{"x-session-id": f"kill-{round_}"})
            cold[round_] = str(record["text"])
            time.sleep(delay)
        finally:
            _kill(proxy)
    proxy = _serve(tiny_gguf, state)
    try:
        kept = _sound(proxy, heads_dir)
        for round_ in cold:  # every conversation answers as it did cold, from a head or not
            _warm_equals_cold(proxy, round_, cold[round_], f"after-{round_}")
        assert "Traceback" not in proxy.log()
        assert len(kept) <= len(cold)
    finally:
        proxy.stop()


@pytest.mark.parametrize("damage", ["deleted", "garbled"])
def test_an_index_lost_with_its_heads_still_there_keeps_them(tiny_gguf: Path, tmp_path: Path, damage: str) -> None:
    state = tmp_path / "state"
    proxy = _serve(tiny_gguf, state)
    try:
        cold = chat_record(proxy, _messages(0), 4, **{"x-session-id": "first"})
        wait_until(lambda: len(http_json(proxy.base + "/adaptive/heads")["heads"]) == 1, 60, "the head's save")
        before = http_json(proxy.base + "/adaptive/heads")["heads"]
    finally:
        proxy.stop()
    index = state / "heads" / "index.json"
    index.unlink() if damage == "deleted" else index.write_text('[{"id": "')
    proxy = _serve(tiny_gguf, state)
    try:
        after = _sound(proxy, state / "heads")
        assert [h["id"] for h in after] == [h["id"] for h in before]  # rebuilt from the head's own entry
        warm = chat_record(proxy, _messages(0), 4, **{"x-session-id": "second"})
        assert warm["timings"]["cache_n"] >= int(str(before[0]["tokens"])) - 1, warm  # and restored
        assert warm["text"] == cold["text"]
    finally:
        proxy.stop()


def test_a_second_serve_on_the_same_state_folder_runs_without_a_store_and_says_why(
    tiny_gguf: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    first = _serve(tiny_gguf, state)
    try:
        second = _serve(tiny_gguf, state)
        try:
            wait_until(lambda: "in use by another adaptive-spec serve" in second.log(), 30, "the second's warning")
            assert f"(pid {first.proc.pid})" in second.log(), second.log()
            assert http_json(second.base + "/adaptive/heads") == {"enabled": False, "heads": []}
            assert chat_record(second, _messages(1), 2, **{"x-session-id": "b"})["status"] == 200
            assert chat_record(first, _messages(2), 2, **{"x-session-id": "a"})["status"] == 200
            wait_until(lambda: http_json(first.base + "/adaptive/heads")["heads"], 60, "the first one's save")
        finally:
            second.stop()
    finally:
        first.stop()


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A real filesystem of 768 MiB (a tmpfs; a save wants 256 MiB free and room for twice its estimated size):
    skipped where this machine refuses mounts (not root, or a container without the right to)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=768m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"no sized tmpfs here ({done.stderr.decode().strip() or 'mount refused'})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_filesystem_costs_saves_not_requests(tiny_gguf: Path, small_filesystem: Path) -> None:
    state = small_filesystem / "state"
    filler = small_filesystem / "filler"
    proxy = _serve(tiny_gguf, state)
    try:
        free = shutil.disk_usage(small_filesystem).free
        with filler.open("wb") as f:  # the disk full but for a few KiB
            f.write(b"\0" * max(0, free - 64 * 1024))
        for team in range(3):
            # ~900 tokens of the tiny model's: a head whose estimated size fits the disk once there is room
            assert chat_record(proxy, _messages(team, 10), 2, **{"x-session-id": f"full-{team}"})["status"] == 200
        wait_until(lambda: http_json(proxy.base + "/adaptive/heads")["pending"] == 0, 60, "the saves to settle")
        described = http_json(proxy.base + "/adaptive/heads")
        assert described["heads"] == [] and described["counts"]["refused"] >= 1, described
        filler.unlink()  # room again: the next first turn is kept
        assert chat_record(proxy, _messages(7, 10), 2, **{"x-session-id": "room"})["status"] == 200
        try:
            wait_until(lambda: http_json(proxy.base + "/adaptive/heads")["heads"], 60, "a save once there is room")
        except AssertionError:
            raise AssertionError("\n".join(x for x in proxy.log().splitlines() if "heads" in x)) from None
        _sound(proxy, state / "heads")
        with urllib.request.urlopen(proxy.base + "/adaptive/health", timeout=10) as resp:
            assert resp.status == 200
    finally:
        proxy.stop()


def test_a_different_model_at_the_same_path_is_never_restored_into(tmp_path: Path) -> None:
    """The heads of one model, and another model written over its file at the same path, of the same size and with
    its time put back: the store knows models by content (sha256), so nothing of the first is restored into the
    second, at start or for a new session."""
    from tests.support.models.tiny_gguf import write_tiny_gguf

    model, state = write_tiny_gguf(tmp_path / "model.gguf", seed=0), tmp_path / "state"
    proxy = _serve(model, state)
    try:
        chat_record(proxy, _messages(0), 4, **{"x-session-id": "first"})
        wait_until(lambda: len(http_json(proxy.base + "/adaptive/heads")["heads"]) == 1, 60, "the head's save")
    finally:
        proxy.stop()
    before = model.stat()
    write_tiny_gguf(tmp_path / "other.gguf", seed=1).replace(model)  # other weights at the same path
    assert model.stat().st_size == before.st_size
    os.utime(model, ns=(before.st_atime_ns, before.st_mtime_ns))
    proxy = _serve(model, state)
    try:
        wait_until(
            lambda: "kept is of" in proxy.log() or "heads restored into" in proxy.log(), 60, "the warm start line"
        )
        assert "heads: none of the 1 kept is of" in proxy.log(), proxy.log()  # not restored into the idle slot
        served = chat_record(proxy, _messages(0), 4, **{"x-session-id": "second"})
        assert "warm:" not in served["reason"] and served["timings"]["cache_n"] < 10, served
        assert http_json(proxy.base + "/adaptive/heads")["counts"]["restored"] == 0
        assert "heads: 1 of 1 heads restored" not in proxy.log()
    finally:
        proxy.stop()
