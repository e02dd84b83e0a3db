"""Faults against real profiles (tiny random-weight model, -t 1), each a scenario that returns its figures:

  sigkill      a profile killed mid-stream: the client's error, a stream on the other profile, requests routed while
               it is down, its restart
  sigstop      a profile stopped (SIGSTOP) with a short --read-timeout: a stream's final error event, a new request's
               504, the slot freed after SIGCONT
  never-healthy  a profile that never answers /health: serve's error, naming a log file that is there
  trace-full   the trace on a full device (/dev/full): requests served, the proxy says so
  disk-full    the trace and the slot directory on a tiny tmpfs (needs root: skipped otherwise)
  cut-slot-file        a KV handoff whose slot file is cut in half after the save (a full disk): not restored,
                       the request still answers, the same text as a fresh server gives
  restore-answer-lost  a KV handoff whose restore's answer is lost half way: the same

Run (from the repository root):  python -m tests.stress.faults [SCENARIO ...] --out faults.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from adaptive_spec.streams.sse import SSEEvent
from tests.stress.rig import write_figures
from tests.support.models.tiny_gguf import write_tiny_gguf
from tests.support.models.tiny_policy import tiny_policy
from tests.support.processes.servers import ProxyProcess, free_port, http_json, pid_alive, wait_until
from tests.support.sse import stream_events

LONG = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 100_000, "ignore_eos": True, "stream": True}
SHORT = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 8, "temperature": 0}


def launched(workdir: Path, *extra: str) -> ProxyProcess:
    """`serve` launching the two default profiles on the tiny model."""
    model = workdir / "tiny-random-llama.gguf"
    if not model.exists():
        write_tiny_gguf(model)
    return ProxyProcess(
        "--model",
        str(model),
        "--threads",
        "1",
        "--ctx-size",
        "8192",
        "--server-per-profile",  # the faults hit one profile's own process and a KV handoff between two
        "--policy",  # the tiny model's handoff costs: its moves are priced as what they are, so they are made
        str(tiny_policy(workdir)),
        *extra,
        env={"ADAPTIVE_SPEC_STATE_DIR": str(workdir / "state"), "ADAPTIVE_SPEC_CONFIG_DIR": str(workdir / "config")},
    )


def profile_pids(proxy: ProxyProcess) -> dict[str, int]:
    """The launched llama-servers by profile (the iterative one drafts with ngram-mod)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == proxy.proc.pid and fields[0] != "Z" and b"llama-server" in cmdline.split(b"\0")[0]:
            found["iterative" if b"ngram-mod" in cmdline else "oneshot"] = int(entry.name)
    return found


def post(proxy: ProxyProcess, body: dict[str, Any], headers: dict[str, str], timeout: float = 60) -> Any:
    req = urllib.request.Request(
        proxy.base + "/v1/chat/completions",
        data=json.dumps({"model": "m", **body}).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    return urllib.request.urlopen(req, timeout=timeout)


def status_of(call: Callable[[], Any]) -> int:
    try:
        with call() as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def last_event(tail: list[SSEEvent]) -> dict[str, Any]:
    if tail and tail[-1].data.startswith("{"):
        return dict(json.loads(tail[-1].data))
    return {"raw": tail[-1].data[-200:] if tail else ""}


def _is_up(proxy: ProxyProcess, name: str) -> bool:
    return bool(http_json(proxy.base + "/adaptive/health")["profiles"][name]["up"])


# --- SIGKILL ----------------------------------------------------------------------------------------------------


def sigkill(workdir: Path) -> dict[str, Any]:
    proxy = launched(workdir, "--parallel", "2")  # the stream on the other profile leaves a slot for the rest
    try:
        pids = profile_pids(proxy)
        other: dict[str, Any] = {}
        other_stream = threading.Thread(target=_read_stream, args=(proxy, "iterative", 2000, other))
        with post(proxy, LONG, {"x-adaptive-spec-profile": "oneshot", "x-session-id": "victim"}) as resp:
            stream = stream_events(resp)
            assert next(stream).data.startswith("{")
            other_stream.start()
            os.kill(pids["oneshot"], signal.SIGKILL)
            killed = time.monotonic()
            tail = list(stream)
            error_after_s = time.monotonic() - killed
        routed = _route_while_down(proxy, "oneshot", killed)
        other_stream.join(60)
        wait_until(lambda: _is_up(proxy, "oneshot"), 60, "the killed profile to come back")
        pinned_after = status_of(lambda: post(proxy, SHORT, {"x-adaptive-spec-profile": "oneshot"}))
        return {
            "client_error": last_event(tail).get("error", {}).get("code"),
            "client_error_after_s": round(error_after_s, 2),
            "other_profile_stream": other,
            "requests_while_down": routed,
            "new_pid": profile_pids(proxy).get("oneshot") not in (None, pids["oneshot"]),
            "pinned_request_after_rejoin": pinned_after,
            "restart_said": "restarting in" in proxy.log(),
        }
    finally:
        proxy.stop()


def _read_stream(proxy: ProxyProcess, profile: str, tokens: int, out: dict[str, Any]) -> None:
    body = {**LONG, "max_tokens": tokens}
    with post(proxy, body, {"x-adaptive-spec-profile": profile, "x-session-id": "bystander"}) as resp:
        data = resp.read()
    out["finished"] = b'"finish_reason":"length"' in data and b"data: [DONE]" in data
    out["error_events"] = data.count(b'"error"')


def _route_while_down(proxy: ProxyProcess, down: str, since: float) -> dict[str, Any]:
    """Unpinned requests sent while `down` is marked down in /adaptive/health: where they went, how they ended, and
    whether the router said why it passed over it."""
    sent: list[str] = []
    statuses: Counter[int] = Counter()
    back_after_s = None
    while time.monotonic() - since < 30:
        if _is_up(proxy, down):
            if sent:
                back_after_s = round(time.monotonic() - since, 2)
                break  # it is back
            time.sleep(0.02)  # the launcher has not noticed the exit yet
            continue
        with post(proxy, SHORT, {"x-session-id": f"while-down-{len(sent)}"}) as resp:
            resp.read()
            request_id, status = resp.headers["x-adaptive-spec-request-id"], resp.status
        if _is_up(proxy, down):
            # It came back while this request was in flight: it may have been routed to it, rightly. Only requests
            # whose whole flight saw the profile down count.
            back_after_s = round(time.monotonic() - since, 2)
            break
        sent.append(request_id)
        statuses[status] += 1
    records = [r for r in proxy.requests() if r["request_id"] in sent]
    return {
        "sent": len(sent),
        "went_to": dict(Counter(r["profile"] for r in records)),
        "statuses": dict(statuses),
        "reason_says_down": sum(1 for r in records if f"{down} is down" in (r["reason"] or "")),
        "up_again_after_s": back_after_s,
    }


# --- SIGSTOP ----------------------------------------------------------------------------------------------------


def sigstop(workdir: Path, read_timeout_s: float = 2.0) -> dict[str, Any]:
    proxy = launched(workdir, "--read-timeout", str(read_timeout_s))
    pids = profile_pids(proxy)
    pinned = {"x-adaptive-spec-profile": "oneshot"}
    try:
        with post(proxy, LONG, {**pinned, "x-session-id": "stopped"}) as resp:
            stream = stream_events(resp)
            assert next(stream).data.startswith("{")
            os.kill(pids["oneshot"], signal.SIGSTOP)
            stopped = time.monotonic()
            tail = list(stream)
            stream_error_after_s = time.monotonic() - stopped
        started = time.monotonic()
        new_request = status_of(lambda: post(proxy, {**LONG, "max_tokens": 16}, {**pinned, "x-session-id": "new"}))
        new_request_after_s = time.monotonic() - started
        other = status_of(lambda: post(proxy, SHORT, {"x-adaptive-spec-profile": "iterative"}))
        os.kill(pids["oneshot"], signal.SIGCONT)
        resumed = time.monotonic()
        wait_until(lambda: not _busy(proxy, "oneshot"), 30, "the stopped profile's slot to be freed")
        freed_after_s = time.monotonic() - resumed
        after = status_of(lambda: post(proxy, SHORT, pinned))
        records = [r for r in proxy.requests() if r["session_id"] in ("stopped", "new")]
        return {
            "read_timeout_s": read_timeout_s,
            "stream_error": last_event(tail).get("error", {}).get("code"),
            "stream_error_after_s": round(stream_error_after_s, 2),
            "new_request_status": new_request,
            "new_request_after_s": round(new_request_after_s, 2),
            "other_profile_status": other,
            "slot_freed_after_sigcont_s": round(freed_after_s, 2),
            "request_after_sigcont": after,
            "records": [(r["status"], r["outcome"], (r["error"] or "")[:80]) for r in records],
        }
    finally:
        if pid_alive(pids["oneshot"]):
            os.kill(pids["oneshot"], signal.SIGCONT)
        proxy.stop()


def _busy(proxy: ProxyProcess, profile: str) -> bool:
    req = urllib.request.Request(proxy.base + "/slots", headers={"x-adaptive-spec-profile": profile})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return any(s.get("is_processing") for s in json.loads(resp.read()))


# --- never healthy ------------------------------------------------------------------------------------------------


def never_healthy(workdir: Path, timeout_s: float = 3.0) -> dict[str, Any]:
    fake = workdir / "llama-server"  # the name the launcher looks for; it loads forever
    fake.write_text("#!/bin/sh\necho 'loading the model, slowly'\nexec sleep 600\n")
    fake.chmod(0o755)
    model = workdir / "tiny-random-llama.gguf"
    write_tiny_gguf(model)
    state = workdir / "state"
    argv = [sys.executable, "-m", "adaptive_spec", "serve", "--port", str(free_port()), "--model", str(model)]
    argv += ["--llama-server", str(fake), "--start-timeout", str(timeout_s)]
    started = time.monotonic()
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "ADAPTIVE_SPEC_STATE_DIR": str(state), "ADAPTIVE_SPEC_CONFIG_DIR": str(workdir / "cfg")},
    )
    error = next((line for line in done.stderr.splitlines() if line.startswith("adaptive-spec: error:")), "")
    named = error.split("log: ", 1)[1].split()[0] if "log: " in error else ""
    leftovers = subprocess.run(["pgrep", "-f", str(fake)], capture_output=True, text=True).stdout.split()
    return {
        "exit_status": done.returncode,
        "seconds": round(time.monotonic() - started, 1),
        "error_line": error,
        "log_named": named,
        "log_is_there": bool(named) and Path(named).is_file(),
        "log_tail_in_message": "loading the model, slowly" in done.stderr,
        "left_running": len(leftovers),
    }


# --- disk full ----------------------------------------------------------------------------------------------------


def trace_full(workdir: Path) -> dict[str, Any]:
    """The trace on /dev/full (every write fails with ENOSPC): no root needed."""
    proxy = launched(workdir, "--trace", "/dev/full")
    try:
        statuses = Counter(status_of(lambda: post(proxy, SHORT, {})) for _ in range(5))
        health = http_json(proxy.base + "/adaptive/health")
        said = [line for line in proxy.stderr_lines if "trace: cannot write" in line]
        return {"statuses": dict(statuses), "health_trace": health.get("trace"), "console_lines": said}
    finally:
        proxy.stop()


@contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def can_mount() -> str | None:
    """None when a tmpfs can be mounted here, else why not."""
    if os.geteuid() != 0:
        return "mounting a small tmpfs needs root"
    probe = Path(tempfile.mkdtemp(prefix="tmpfs-probe-"))
    try:
        with tmpfs(probe, "64k"):
            return None
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"cannot mount a tmpfs here: {exc}"
    finally:
        probe.rmdir()


def disk_full(workdir: Path) -> dict[str, Any]:
    """The trace and the launched profiles' slot directory on a 64 KiB tmpfs each: requests keep being served, the
    trace says it stopped and started again, and a session moved between profiles is re-prefilled."""
    with tmpfs(workdir / "trace-fs", "64k") as trace_dir:
        proxy = launched(workdir, "--trace", str(trace_dir / "trace.jsonl"), "--trace-content")
        try:
            slot_dirs = list((workdir / "state").glob("run-*/slots"))
            with tmpfs(slot_dirs[0], "16k"):
                return _fill_and_serve(proxy, trace_dir)
        finally:
            proxy.stop()


def _fill_and_serve(proxy: ProxyProcess, trace_dir: Path) -> dict[str, Any]:
    filler = trace_dir / "filler"
    with filler.open("wb") as out, _suppress_enospc():
        out.write(b"x" * 1024 * 1024)
    big = {**SHORT, "messages": [{"role": "user", "content": "Explain this. " * 200}]}
    statuses = Counter(status_of(lambda: post(proxy, big, {"x-session-id": "full"})) for _ in range(4))
    # The session moves to the other profile: the slot save has no room; it is served all the same.
    moved = status_of(lambda: post(proxy, big, {"x-session-id": "full", "x-adaptive-spec-profile": "iterative"}))
    health_full = http_json(proxy.base + "/adaptive/health").get("trace")
    filler.unlink()
    again = status_of(lambda: post(proxy, SHORT, {}))
    handoffs = http_json(proxy.base + "/adaptive/route")["handoffs"]
    record = next(r for r in reversed(proxy.requests()) if r["session_id"] == "full")
    lines = (trace_dir / "trace.jsonl").read_text().splitlines()
    return {
        "statuses_while_full": dict(statuses),
        "moved_status": moved,
        "moved_handoff": record.get("handoff"),
        "handoffs": handoffs,
        "health_trace_while_full": health_full,
        "status_after_space_freed": again,
        "health_trace_after": http_json(proxy.base + "/adaptive/health").get("trace"),
        "console": [line for line in proxy.stderr_lines if line.startswith("trace:")],
        "last_trace_line_parses": _parses(lines[-1]) if lines else False,
    }


@contextmanager
def _suppress_enospc() -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        if exc.errno != 28:
            raise


def _parses(line: str) -> bool:
    try:
        json.loads(line)
    except ValueError:
        return False
    return True


# --- a restore that fails half way --------------------------------------------------------------------------------


def cut_slot_file(workdir: Path) -> dict[str, Any]:
    from tests.stress.restore_fault import run_slot_fault

    return asyncio.run(run_slot_fault(workdir, "cut-after-save"))


def restore_answer_lost(workdir: Path) -> dict[str, Any]:
    from tests.stress.restore_fault import run_slot_fault

    return asyncio.run(run_slot_fault(workdir, "restore-answer-lost"))


Scenario = Callable[[Path], dict[str, Any]]
SCENARIOS: dict[str, Scenario] = {
    "sigkill": sigkill,
    "sigstop": sigstop,
    "never-healthy": never_healthy,
    "trace-full": trace_full,
    "disk-full": disk_full,
    "cut-slot-file": cut_slot_file,
    "restore-answer-lost": restore_answer_lost,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("scenarios", nargs="*", metavar="SCENARIO", help=f"of {', '.join(SCENARIOS)} (default: all)")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
    args = parser.parse_args(argv)
    unknown = [s for s in args.scenarios if s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario {unknown[0]!r}")
    figures: dict[str, Any] = {}
    for name in args.scenarios or list(SCENARIOS):
        if name == "disk-full" and (why := can_mount()) is not None:
            figures[name] = {"skipped": why}
            continue
        with tempfile.TemporaryDirectory() as tmp:
            figures[name] = SCENARIOS[name](Path(tmp))
    write_figures(figures, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
