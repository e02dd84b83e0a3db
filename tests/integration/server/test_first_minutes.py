"""What a newcomer sees at the command line, on a REAL `adaptive-spec serve` with launched llama-servers: a taken
port refused before anything starts, a clean start without native library chatter, what to do next, and the SDK
example following OPENAI_BASE_URL."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.processes.servers import LlamaServer, ProxyProcess, http_json, wait_until

ROOT = Path(__file__).resolve().parents[3]
# How llama.cpp's own log lines begin (llama-cpp-python's loader, ggml, the server): none belongs in the terminal.
NATIVE = re.compile(r"^(llama_|ggml_|gguf_|llm_|load|print_info|init_|common_|main:|build:|system_info|srv |slot )")


def recording_server(folder: Path, binary: str) -> tuple[Path, Path]:
    """A --llama-server that writes a line to a file each time it is started as a server (the `--help` that tells
    what the binary offers is not a start), then becomes the real llama-server."""
    record = folder / "launches.txt"
    wrapper = folder / "llama-server"
    log_start = f'[ "$1" = --help ] || echo "$$" >> {shlex.quote(str(record))}'
    wrapper.write_text(f'#!/bin/sh\n{log_start}\nexec {shlex.quote(binary)} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, record


def serve_argv(tiny_gguf: Path, wrapper: Path, *extra: str) -> list[str]:
    return ["--model", str(tiny_gguf), "--llama-server", str(wrapper), "--threads", "1", "--ctx-size", "4096", *extra]


@pytest.fixture(scope="module")
def started(
    tiny_gguf: Path, llama_server_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ProxyProcess, Path]]:
    folder = tmp_path_factory.mktemp("first-minutes")
    wrapper, record = recording_server(folder, llama_server_binary)
    proxy = ProxyProcess(*serve_argv(tiny_gguf, wrapper), env={"ADAPTIVE_SPEC_STATE_DIR": str(folder / "state")})
    # stdout said it is serving; the lines after it on stderr may still be on their way
    wait_until(lambda: any(s.startswith("agent setups:") for s in proxy.stderr_lines), 30, "the next-steps lines")
    yield proxy, record
    proxy.stop()


def test_a_taken_port_fails_before_any_llama_server_starts(
    tiny_gguf: Path, llama_server_binary: str, tmp_path: Path
) -> None:
    wrapper, record = recording_server(tmp_path, llama_server_binary)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "adaptive_spec", "serve", "--port", str(port), *serve_argv(tiny_gguf, wrapper)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "ADAPTIVE_SPEC_STATE_DIR": str(tmp_path / "state")},
        )
    assert done.returncode == 1, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in done.stderr
    assert "starting profile" not in done.stderr
    assert not record.exists(), "a llama-server was started although the port was taken"
    assert done.stdout == ""


def test_an_unknown_default_profile_fails_before_any_llama_server_starts(
    tiny_gguf: Path, llama_server_binary: str, tmp_path: Path
) -> None:
    wrapper, record = recording_server(tmp_path, llama_server_binary)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "adaptive_spec",
            "serve",
            "--port",
            "0",
            "--default-profile",
            "fast",
            *serve_argv(tiny_gguf, wrapper),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "ADAPTIVE_SPEC_STATE_DIR": str(tmp_path / "state")},
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr == "adaptive-spec: error: --default-profile 'fast' is not one of oneshot, iterative\n"
    assert not record.exists()


def test_a_clean_start_has_no_native_log_lines(started: tuple[ProxyProcess, Path]) -> None:
    proxy, record = started
    # One server for both profiles where llama-server takes speculation per request, else one each.
    servers = 1 if "profiles: one llama-server, speculation per request" in proxy.log() else 2
    assert len(record.read_text().split()) == servers, "the recording llama-server started the profiles' servers"
    assert "sessions: tokens from gguf:" in proxy.log(), "the GGUF tokenizer (llama-cpp-python) was loaded"
    chatter = [line for line in proxy.stderr_lines if NATIVE.match(line) or "n_ctx_train" in line]
    assert chatter == []


@pytest.mark.parametrize("verbose", [False, True], ids=["quiet", "verbose"])
def test_loading_the_gguf_tokenizer_logs_only_when_verbose(tiny_gguf: Path, verbose: bool) -> None:
    code = (
        "import sys; from adaptive_spec.sessions.tokenizers import llama_vocab_tokenizer; "
        f"assert llama_vocab_tokenizer(sys.argv[1], {verbose}) is not None"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tiny_gguf)], capture_output=True, text=True, timeout=120, check=True
    )
    native = [line for line in (done.stdout + done.stderr).splitlines() if NATIVE.match(line)]
    assert bool(native) == verbose, done.stderr[-2000:]


def test_it_says_its_event_loop(started: tuple[ProxyProcess, Path]) -> None:
    proxy, _ = started
    # stderr is read apart from stdout: the line may come in just after the ready line
    wait_until(lambda: "event loop: asyncio" in proxy.stderr_lines, 30, "the event loop line")  # the default
    assert http_json(proxy.base + "/v1/models")["data"]


@pytest.mark.skipif(importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed")
def test_it_serves_on_uvloop_when_asked(tiny_server: LlamaServer, tmp_path: Path) -> None:
    proxy = ProxyProcess(
        "--profile",
        f"plain={tiny_server.url}",
        "--event-loop",
        "uvloop",
        env={"ADAPTIVE_SPEC_STATE_DIR": str(tmp_path)},
    )
    try:
        wait_until(lambda: "event loop: uvloop" in proxy.stderr_lines, 30, "the event loop line")
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        assert http_json(proxy.base + "/v1/chat/completions", body)["choices"]
    finally:
        proxy.stop()


def test_after_serving_it_says_what_to_do_next(started: tuple[ProxyProcess, Path]) -> None:
    proxy, _ = started
    wait_until(lambda: len(proxy.stdout_lines) >= 3, 5, "the third base-URL line")
    assert proxy.stdout_lines == [
        f"OPENAI_BASE_URL={proxy.base}/v1",
        f"ANTHROPIC_BASE_URL={proxy.base}",
        f"GOOGLE_GEMINI_BASE_URL={proxy.base}",
    ]
    after = proxy.stderr_lines[next(i for i, s in enumerate(proxy.stderr_lines) if "is serving" in s) + 1 :]
    assert f"adaptive-spec tui --url {proxy.base}" in after[0]
    assert f"agent setups: {ROOT / 'examples'} (" in after[1]
    # The agents' waits no keep-alive resets, each with what to set (sessions/agents/client_limits.py).
    limits = next(s for s in after if "waits the keep-alives cannot reset" in s)
    assert "CLAUDE_STREAM_IDLE_TIMEOUT_MS" in limits and "QWEN_STREAM_MAX_LIFETIME_MS" in limits


def test_the_sdk_example_follows_openai_base_url(started: tuple[ProxyProcess, Path]) -> None:
    proxy, _ = started
    env = {**os.environ, "OPENAI_BASE_URL": f"{proxy.base}/p/newcomer/v1", "OPENAI_API_KEY": "sk-newcomer"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "openai_sdk.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=True,
    )
    printed = json.loads(done.stdout[done.stdout.rindex("\n{\n") :])  # the proxy's record, after the reply
    assert printed["project"] == "newcomer"
    assert printed["request_id"] == proxy.requests()[-1]["request_id"]
