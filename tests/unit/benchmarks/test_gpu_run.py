"""benchmarks/gpu/run.py: the steps of the GPU run that need no GPU — the commands it would run, the check of the
build, and stopping where there is no GPU before anything is built."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import benchmarks.gpu.run

ROOT = Path(__file__).resolve().parents[3]


def _module() -> ModuleType:
    return benchmarks.gpu.run


def test_the_plan_builds_with_cuda_serves_the_drafter_pair_and_benches_three_workloads() -> None:
    gpu = _module()
    steps = gpu.plan("py", 8089, Path("out"), 16)
    lines = [s.shell() for s in steps]
    assert lines[0].startswith("nvidia-smi ")
    assert lines[1] == "CMAKE_ARGS=-DGGML_CUDA=on py -m adaptive_spec build-server --jobs 16"
    assert lines[2].endswith("-m benchmarks.gpu.run --check-build")
    assert lines[3:5] == [
        "py -m adaptive_spec model qwen2.5-coder-1.5b",
        "py -m adaptive_spec model qwen2.5-coder-0.5b",
    ]
    assert lines[5] == (
        "py -m adaptive_spec serve --model embedded:qwen2.5-coder-1.5b --draft embedded:qwen2.5-coder-0.5b "
        "--draft-type simple --server-arg=-ngl --server-arg=all --server-arg=-ngld --server-arg=all --port 8089 &"
    )
    assert lines[6] == (
        "py -m adaptive_spec bench --url http://127.0.0.1:8089 --workload iterative --workload oneshot "
        "--workload mixed --adaptive --out out"
    )
    assert [s.title for s in gpu.plan("py", 1, Path("o"), 1, build=False)][:2] == [
        "check the GPU",
        "check that the build says cuda",
    ]


def test_the_serve_and_bench_commands_parse_with_this_cli() -> None:
    # The printed commands are the CLI's own: its parser accepts them (the drafter type, the server arguments).
    from adaptive_spec.cli.main import _parser as build_parser

    gpu = _module()
    steps = gpu.plan("py", 8089, Path("out"), 1)
    for step in [steps[1], *steps[3:]]:
        args = build_parser().parse_args(list(step.argv[3:]))
        assert args.command in ("build-server", "model", "serve", "bench")
    serve = build_parser().parse_args(list(steps[5].argv[3:]))
    assert serve.draft_type == "simple" and serve.server_arg == ["-ngl", "all", "-ngld", "all"]


def test_the_build_check_wants_cuda() -> None:
    gpu = _module()
    assert gpu.build_problem({"cmake_args": ["-DGGML_CUDA=on", "-DCMAKE_CUDA_ARCHITECTURES=89"]}) is None
    cpu = gpu.build_problem({"cmake_args": []})
    assert cpu is not None and "configured with no CMAKE_ARGS, not -DGGML_CUDA=on" in cpu
    assert "adaptive-spec build-server" in gpu.build_problem(None)


def _run(*args: str, path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": path} if path is not None else None
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu.run", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
    )


def test_dry_run_prints_every_command_and_runs_none(tmp_path: Path) -> None:
    done = _run("--dry-run", "--port", "9123", "--out", str(tmp_path / "gpu"))
    assert done.returncode == 0, done.stderr
    assert "CMAKE_ARGS=-DGGML_CUDA=on" in done.stdout and "--draft-type simple" in done.stdout
    assert "--port 9123 &" in done.stdout and "kill %1" in done.stdout
    assert not (tmp_path / "gpu").exists()


def test_without_a_gpu_it_stops_before_building(tmp_path: Path) -> None:
    # No nvidia-smi on PATH (a machine without an NVIDIA driver): the first step fails and nothing else runs.
    done = _run("--out", str(tmp_path / "gpu"), path=str(tmp_path))
    assert done.returncode == 2
    assert "nvidia-smi: not found" in done.stderr and "build llama-server" not in done.stdout
    assert not (tmp_path / "gpu").exists()


def test_the_check_build_step_reads_this_install() -> None:
    gpu = _module()
    info = gpu.installed_build_info()
    done = _run("--check-build")
    if gpu.build_problem(info) is None:
        assert done.returncode == 0
    else:  # this machine's llama-server (a CPU build), or none
        assert done.returncode == 1
        assert "not -DGGML_CUDA=on" in done.stderr or "build-server" in done.stderr
