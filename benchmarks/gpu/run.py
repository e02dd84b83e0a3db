"""The GPU run of docs/gpu.md, as one script: build the patched llama-server with CUDA (`adaptive-spec build-server`
with CMAKE_ARGS), serve
the embedded Qwen2.5-Coder-1.5B with the 0.5B as a real model drafter (`oneshot`: the drafter alone; `iterative`: the
drafter + ngram-mod), and bench the three built-in workloads with --adaptive (two order-balanced rounds).

Run:  python -m benchmarks.gpu.run [--dry-run] [--skip-build] [--port 8089] [--out results/gpu] [--jobs N]

--dry-run prints every command and runs none (no GPU needed). Without it the script stops, before building
anything, where there is no NVIDIA GPU (`nvidia-smi` missing or failing), and after the build where the current
llama-server build was not configured for CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

TARGET = "qwen2.5-coder-1.5b"
DRAFTER = "qwen2.5-coder-0.5b"
WORKLOADS = ("iterative", "oneshot", "mixed")


@dataclass(frozen=True, slots=True)
class Step:
    title: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    background: bool = False  # the server: started, waited for, stopped after the bench

    def shell(self) -> str:
        """The command as a user types it in a POSIX shell."""
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        line = shlex.join(self.argv) + (" &" if self.background else "")
        return f"{prefix} {line}" if prefix else line


def plan(python: str, port: int, out: Path, jobs: int, build: bool = True) -> list[Step]:
    """Every step, in order. The build is the patched llama-server's, with CUDA on: a build is kept per CMAKE_ARGS,
    so it compiles once and the CPU build stays as it was."""
    cli = (python, "-m", "adaptive_spec")
    steps = [Step("check the GPU", ("nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"))]
    if build:
        steps.append(
            Step(
                "build the patched llama-server with CUDA (10-30 min)",
                (*cli, "build-server", "--jobs", str(jobs)),
                {"CMAKE_ARGS": "-DGGML_CUDA=on"},
            )
        )
    steps += [
        Step("check that the build says cuda", (python, "-m", "benchmarks.gpu.run", "--check-build")),
        Step("assemble the target model", (*cli, "model", TARGET)),
        Step("assemble the drafter", (*cli, "model", DRAFTER)),
        Step(
            "serve: oneshot = 0.5B drafter, iterative = 0.5B drafter + ngram-mod; every layer on the GPU",
            (
                *cli,
                "serve",
                "--model",
                f"embedded:{TARGET}",
                "--draft",
                f"embedded:{DRAFTER}",
                "--draft-type",
                "simple",
                "--server-arg=-ngl",
                "--server-arg=all",
                "--server-arg=-ngld",
                "--server-arg=all",
                "--port",
                str(port),
            ),
            background=True,
        ),
        Step(
            "bench the three workloads, adaptive and each profile pinned, two order-balanced rounds",
            (
                *cli,
                "bench",
                "--url",
                f"http://127.0.0.1:{port}",
                *(a for w in WORKLOADS for a in ("--workload", w)),
                "--adaptive",
                "--out",
                str(out),
            ),
        ),
    ]
    return steps


def build_problem(build_info: Mapping[str, object] | None) -> str | None:
    """Why the current llama-server build cannot run the GPU bench, or None when it was configured for CUDA."""
    if build_info is None:
        return "no patched llama-server is built: is adaptive-spec installed? (adaptive-spec build-server)"
    args = [str(a) for a in build_info.get("cmake_args", []) or []]  # type: ignore[attr-defined]
    if not any(a.upper() in ("-DGGML_CUDA=ON", "-DGGML_CUDA=1") for a in args):
        shown = " ".join(args) or "no CMAKE_ARGS"
        return (
            f"the current llama-server build was configured with {shown}, not -DGGML_CUDA=on: rerun the build step "
            "with CMAKE_ARGS=-DGGML_CUDA=on and check that the CUDA toolkit (nvcc) is found"
        )
    return None


def installed_build_info() -> dict[str, object] | None:
    """The current build's manifest (what `adaptive-spec build-server --show` prints), as a dict."""
    from adaptive_spec.llama.binary.pinned import find_built

    found = find_built()
    if found is None:
        return None
    info: dict[str, object] = json.loads(found.manifest.to_json())
    return info


def _wait_ready(port: int, server: subprocess.Popen[bytes], timeout_s: float = 900.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"adaptive-spec serve exited with {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/adaptive/profiles", timeout=5) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise SystemExit(f"adaptive-spec serve was not ready on port {port} after {timeout_s:.0f} s")


def run(steps: Sequence[Step], port: int) -> int:
    server: subprocess.Popen[bytes] | None = None
    try:
        for step in steps:
            print(f"\n== {step.title}\n$ {step.shell()}", flush=True)
            env = {**os.environ, **step.env}
            if step.background:
                server = subprocess.Popen(step.argv, env=env)
                _wait_ready(port, server)
                continue
            try:
                done = subprocess.run(step.argv, env=env, check=False)
            except FileNotFoundError:
                print(f"{step.argv[0]}: not found", file=sys.stderr)
                return 2
            if done.returncode != 0:
                print(f"step failed ({done.returncode}): {step.title}", file=sys.stderr)
                return 2
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=60)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run none")
    parser.add_argument("--skip-build", action="store_true", help="llama-server is already built with CUDA")
    parser.add_argument("--check-build", action="store_true", help="only say whether llama-server was built for CUDA")
    parser.add_argument("--port", type=int, default=8089)
    parser.add_argument("--out", type=Path, default=Path("results/gpu"))
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 4, help="parallel compile jobs")
    args = parser.parse_args(argv)
    if args.check_build:
        info = installed_build_info()
        print(json.dumps(info, indent=2))
        problem = build_problem(info)
        if problem:
            print(problem, file=sys.stderr)
        return 1 if problem else 0
    steps = plan(sys.executable, args.port, args.out, args.jobs, build=not args.skip_build)
    if args.dry_run:
        for step in steps:
            print(f"# {step.title}\n{step.shell()}")
        print(f"# when the bench is done, stop the server\nkill %1\n# results: {args.out}/bench.md, bench.png")
        return 0
    return run(steps, args.port)


if __name__ == "__main__":
    sys.exit(main())
