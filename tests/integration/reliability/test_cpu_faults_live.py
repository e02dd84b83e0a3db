"""A llama-server that dies of a CPU fault while loading is started again with `--no-repack`, once, and the machine
remembers it; one that dies after it served is restarted with its own arguments, and said.

The fault is made by a wrapper script: a real CPU that faults on AMX cannot be had on demand. The wrapper kills itself
with SIGSEGV (as llama.cpp #20824 does in `ggml_backend_amx_mul_mat`) unless `--no-repack` is among its arguments,
and otherwise runs the real llama-server with them, so what serves is real."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from adaptive_spec.errors import LaunchError
from adaptive_spec.llama.binary.cpu_faults import CLEAR_HINT, REPACK_COST, RepackMode, VerdictStore
from adaptive_spec.llama.launch import Launcher, ServerProcess, free_port
from adaptive_spec.llama.profiles import ModelSource, ProfileSpec, ServerSettings
from tests.support.processes.servers import ProxyProcess, chat_record

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


# A fake llama-server for the retry itself, no model: it writes each start's arguments to a file, and while
# "loading" dies as FAKE_DEATH says (a signal's name, or a wrapper's exit status) unless --no-repack is given;
# otherwise it answers /health until it is stopped.
FAULTS_WHILE_LOADING = """#!{python}
import http.server, os, signal, sys
args = sys.argv[1:]
with open(os.environ["FAKE_STARTS"], "a") as starts:
    starts.write(" ".join(args) + "\\n")
print("load_tensors:  AMX model buffer size =    10.00 MiB", flush=True)
if "--no-repack" not in args:
    death = os.environ["FAKE_DEATH"]
    print("ggml_backend_amx_mul_mat: fault (simulated)", flush=True)
    if death.isdigit():
        sys.exit(int(death))
    os.kill(os.getpid(), getattr(signal, death))

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b'{{"status": "ok"}}')
    def log_message(self, *a):
        pass

port = int(args[args.index("--port") + 1])
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def _fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, death: str) -> tuple[str, Path]:
    binary = tmp_path / "fake-llama-server"
    binary.write_text(FAULTS_WHILE_LOADING.format(python=sys.executable))
    binary.chmod(0o755)
    starts = tmp_path / "starts"
    monkeypatch.setenv("FAKE_STARTS", str(starts))
    monkeypatch.setenv("FAKE_DEATH", death)
    return str(binary), starts


def _start(binary: str, store: VerdictStore, log: Path, repack: RepackMode = "auto") -> tuple[ServerProcess, list[str]]:
    """One start through the product's ServerProcess; it is stopped again before this returns."""
    port = free_port("127.0.0.1")
    said: list[str] = []
    server = ServerProcess(
        "fake", [binary, "--port", str(port)], f"http://127.0.0.1:{port}", log, said.append,
        repack=repack, verdicts=store,
    )  # fmt: skip

    async def run() -> None:
        await server.start(health_timeout_s=30)
        await server.stop()

    try:
        asyncio.run(run())
    except LaunchError as exc:
        said.append(str(exc))
    return server, said


@pytest.mark.parametrize(
    ("death", "fault"),
    [
        ("SIGSEGV", "SIGSEGV"),  # llama.cpp #20824: the AMX kernel of a Q4_K_M model
        ("SIGILL", "SIGILL"),  # an instruction the VM advertises and does not run
        ("SIGBUS", "SIGBUS"),
        (str(128 + signal.SIGSEGV), "SIGSEGV"),  # a wrapper that exits with its child's status, as a shell does
        (str(128 + signal.SIGILL), "SIGILL"),
    ],
)
def test_a_loading_fault_is_retried_once_with_no_repack_and_the_next_start_goes_straight_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, death: str, fault: str
) -> None:
    binary, starts = _fake(tmp_path, monkeypatch, death)
    store = VerdictStore(tmp_path / "state" / "cpu-verdicts.json")
    server, said = _start(binary, store, tmp_path / "first.log")
    assert server.no_repack, said
    text = "\n".join(said)
    assert f"died of {fault} while loading" in text and "retrying with --no-repack" in text
    assert "ggml_backend_amx_mul_mat: fault (simulated)" in text  # the server's own last lines
    assert "this machine remembers it for this build" in text and REPACK_COST in text
    assert [line.endswith("--no-repack") for line in starts.read_text().splitlines()] == [False, True]
    verdict = store.get(binary)
    assert verdict is not None and verdict.fault == fault

    # The next start (a new process reading the same file) uses the remembered arguments: no crash first.
    server, said = _start(binary, VerdictStore(store.path), tmp_path / "second.log")
    text = "\n".join(said)
    assert server.no_repack and "retrying" not in text
    assert f"this build runs with --no-repack (it died of {fault} while loading" in text
    assert CLEAR_HINT in text and REPACK_COST in text
    assert [line.endswith("--no-repack") for line in starts.read_text().splitlines()] == [False, True, True]


def test_cpu_repack_always_is_not_retried_and_never_adds_no_repack_from_the_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    binary, starts = _fake(tmp_path, monkeypatch, "SIGSEGV")
    store = VerdictStore(tmp_path / "cpu-verdicts.json")
    store.remember(binary, signal.SIGSEGV)  # what the machine remembers, ignored when told to repack
    server, said = _start(binary, store, tmp_path / "always.log", repack="always")
    assert not server.no_repack
    assert any(f"exited with status {-signal.SIGSEGV} while loading" in line for line in said), said
    assert not any("retrying" in line for line in said)
    assert starts.read_text().splitlines() == [f"--port {server.argv[2]}"]

    starts.unlink()
    store.forget()
    server, said = _start(binary, store, tmp_path / "never.log", repack="never")
    assert server.no_repack and not any("died of" in line for line in said), said
    assert len(starts.read_text().splitlines()) == 1  # the first start already had it
    assert store.get(binary) is None  # a choice, not a verdict


STOCK_PROPS = Path(__file__).resolve().parents[2] / "support" / "fakes" / "stock_props.py"


def test_the_stock_props_wrapper_dies_of_its_child_s_signal_so_the_retry_sees_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tests/support/fakes/stock_props.py stands in for a stock llama-server: a child that faults while loading must
    look the same through it (the signal, not an exit status the retry might not read)."""
    binary, _ = _fake(tmp_path, monkeypatch, "SIGSEGV")
    port = free_port("127.0.0.1")
    done = subprocess.run(
        [sys.executable, str(STOCK_PROPS), "wrap", binary, "--port", str(port)], capture_output=True, timeout=60
    )
    assert done.returncode == -signal.SIGSEGV, done
    wrapper = tmp_path / "stock-llama-server"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {STOCK_PROPS} wrap {binary} "$@"\n')
    wrapper.chmod(0o755)
    server, said = _start(str(wrapper), VerdictStore(tmp_path / "cpu-verdicts.json"), tmp_path / "wrapped.log")
    assert server.no_repack and any("died of SIGSEGV while loading" in line for line in said), said
