"""A llama-server that dies of a CPU fault while loading is started again with `--no-repack`, once, and the machine
remembers it; one that dies after it served is restarted with its own arguments, and said.

The fault is made by a wrapper script: a real CPU that faults on AMX cannot be had on demand. The wrapper kills itself
with SIGSEGV (as llama.cpp #20824 does in `ggml_backend_amx_mul_mat`) unless `--no-repack` is among its arguments,
and otherwise runs the real llama-server with them, so what serves is real."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest

from adaptive_spec.servers.cpu_faults import VerdictStore
from adaptive_spec.servers.launcher import Launcher, ServerProcess, free_port
from adaptive_spec.servers.profiles import ModelSource, ProfileSpec, ServerSettings
from tests.support.servers import ProxyProcess, chat_record

FAULTS_UNLESS_NO_REPACK = """#!/bin/sh
echo "load_tensors:  AMX model buffer size =    10.00 MiB"
case " $* " in *" --no-repack "*) exec {real} "$@";; esac
echo "ggml_backend_amx_mul_mat: fault (simulated)"
kill -{signal} $$
"""


def _wrapper(tmp_path: Path, real: str, sig: str = "SEGV", name: str = "faulty-llama-server") -> str:
    path = tmp_path / name
    path.write_text(FAULTS_UNLESS_NO_REPACK.format(real=real, signal=sig))
    path.chmod(0o755)
    return str(path)


def _env(home: Path, binary: str) -> dict[str, str]:
    return {
        "ADAPTIVE_SPEC_STATE_DIR": str(home / "state"),
        "ADAPTIVE_SPEC_CONFIG_DIR": str(home / "config"),
        "ADAPTIVE_SPEC_LLAMA_SERVER": binary,
    }


def test_serve_retries_a_loading_fault_and_the_next_start_uses_the_verdict(
    llama_server_binary: str, tiny_gguf: Path, tmp_path: Path
) -> None:
    binary = _wrapper(tmp_path, llama_server_binary)
    args = ("--model", str(tiny_gguf), "--threads", "1", "--ctx-size", "2048")
    proxy = ProxyProcess(*args, env=_env(tmp_path, binary), ready_timeout=120)
    try:
        log = proxy.log()
        assert "died of SIGSEGV while loading" in log and "retrying with --no-repack" in log
        assert "ggml_backend_amx_mul_mat" in log  # the server's own last lines, so a person sees why
        assert "this machine remembers it for this build" in log
        assert chat_record(proxy, [{"role": "user", "content": "hi"}], 4)["status"] == 200
    finally:
        proxy.stop()
    verdicts = VerdictStore(tmp_path / "state" / "cpu-verdicts.json")
    remembered = verdicts.get(binary)
    assert remembered is not None and remembered.fault == "SIGSEGV"

    again = ProxyProcess(*args, env=_env(tmp_path, binary), ready_timeout=120)
    try:
        log = again.log()
        assert "while loading (a CPU kernel" not in log  # straight to the arguments that work: no crash first
        assert "retrying with --no-repack" not in log
        assert "this build runs with --no-repack (it died of SIGSEGV" in log
        assert "--forget-cpu-verdicts" in log
        assert chat_record(again, [{"role": "user", "content": "hi"}], 4)["status"] == 200
    finally:
        again.stop()

    # Told to repack whatever the machine remembers: the wrapper faults, and nothing retries it.
    with pytest.raises(AssertionError) as failed:
        ProxyProcess(*args, "--cpu-repack", "always", env=_env(tmp_path, binary), ready_timeout=60)
    assert "exited with status -11 while loading" in str(failed.value)
    assert "retrying" not in str(failed.value)


def test_a_verdict_is_kept_only_once_the_retry_has_served(tmp_path: Path) -> None:
    """A build that faults with and without --no-repack (a broken binary, not repacking) leaves no verdict."""
    always = tmp_path / "always-faults"
    always.write_text("#!/bin/sh\nkill -ILL $$\n")
    always.chmod(0o755)
    store = VerdictStore(tmp_path / "cpu-verdicts.json")
    port = free_port("127.0.0.1")
    said: list[str] = []
    server = ServerProcess(
        "t", [str(always), "--port", str(port)], f"http://127.0.0.1:{port}", tmp_path / "t.log", said.append,
        verdicts=store,
    )  # fmt: skip
    with pytest.raises(Exception, match="exited with status -4 while loading"):
        asyncio.run(server.start(health_timeout_s=20))
    assert any("died of SIGILL" in line for line in said)
    assert store.get(str(always)) is None


DIES_AFTER_SERVING = """#!/usr/bin/env python3
import http.server, os, signal, sys, threading
args = sys.argv[1:]
port = int(args[args.index("--port") + 1])
print("started with", " ".join(args), flush=True)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b'{"status": "ok"}')
    def log_message(self, *a):
        pass

server = http.server.HTTPServer(("127.0.0.1", port), Health)
threading.Thread(target=server.serve_forever, daemon=True).start()
marker = os.environ["FAKE_MARKER"]
if not os.path.exists(marker):  # the first run dies a second after it served; the restart keeps running
    open(marker, "w").close()
    threading.Event().wait(1.0)
    print("segfault in a decode (simulated)", flush=True)
    os.kill(os.getpid(), signal.SIGSEGV)
threading.Event().wait()
"""


def test_a_death_after_serving_is_restarted_with_the_same_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    binary = tmp_path / "fake-llama-server"
    binary.write_text(DIES_AFTER_SERVING)
    binary.chmod(0o755)
    monkeypatch.setenv("FAKE_MARKER", str(tmp_path / "died-once"))
    monkeypatch.setenv("ADAPTIVE_SPEC_STATE_DIR", str(tmp_path / "state"))
    settings = ServerSettings(model=ModelSource.parse(str(tmp_path / "m.gguf")), threads=1)
    said: list[str] = []
    ups: list[str] = []

    async def scenario() -> list[str]:
        launcher = Launcher(
            str(binary), [ProfileSpec("plain", ("none",))], settings, run_dir=tmp_path / "run", say=said.append
        )
        launcher.set_health_hooks(ups.append, lambda _n, _r: None)
        try:
            await launcher.start()
            for _ in range(200):  # up, died, restarted, up again
                if len(ups) >= 2:
                    break
                await asyncio.sleep(0.05)
            return (tmp_path / "run" / "logs" / "plain.log").read_text().splitlines()
        finally:
            await launcher.stop()

    log = asyncio.run(scenario())
    assert len(ups) == 2, said
    died = next(line for line in said if "exited with status" in line)
    assert f"status {-signal.SIGSEGV}; restarting" in died and "segfault in a decode (simulated)" in died
    starts = [line for line in log if line.startswith("started with")]
    assert len(starts) == 2 and all("--no-repack" not in line for line in starts)
    assert not (tmp_path / "state" / "cpu-verdicts.json").exists()
