"""`adaptive-spec build-server`: compile the patched llama-server once (the README's two commands run it), or say
which build is in use."""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from adaptive_spec.cli.text import add_command
from adaptive_spec.llama.binary import pinned as build
from adaptive_spec.llama.binary.cpu_faults import CLEAR_HINT, REPACK_COST

EPILOG = """\
examples:
  adaptive-spec build-server                              build once (then instant: the build is kept)
  CMAKE_ARGS="-DGGML_CUDA=on" adaptive-spec build-server  a CUDA build (see docs/gpu.md)
  adaptive-spec build-server --show                       which build serve will use, and what it carries
  adaptive-spec build-server --source ~/llama.cpp         the patches on your own llama.cpp tree (or tarball)
  adaptive-spec serve --llama-server "$(adaptive-spec build-server --print-path)"
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cmd = add_command(
        sub,
        "build-server",
        "compile the patched llama-server (per-request speculation) from the pinned llama.cpp source",
        "Compiles llama-server from the llama.cpp source in the pinned xllamacpp sdist (b11549), with adaptive-spec's\n"
        "patches applied (per-request speculation: see src/adaptive_spec/llama/binary/patches/README.md), into the\n"
        "cache directory. CMAKE_ARGS passes through (e.g. -DGGML_CUDA=on). A build is kept per patch set and\n"
        "CMAKE_ARGS: running it again with the same ones does nothing.",
        EPILOG,
    )
    cmd.add_argument("--jobs", type=int, help="parallel compile jobs (default: the number of cores)")
    cmd.add_argument("--force", action="store_true", help="build again even when a matching build exists")
    cmd.add_argument("--show", action="store_true", help="say which build is current and what it carries; build none")
    cmd.add_argument("--print-path", action="store_true", help="print only the binary's path (building if needed)")
    cmd.add_argument(
        "--forget-cpu-verdicts",
        action="store_true",
        help="forget which builds this machine runs with --no-repack (a CPU that faulted while loading); the next "
        "start finds out again",
    )
    cmd.add_argument(
        "--check", action="store_true", help="only check that the patches apply to the pinned source (downloads it)"
    )
    cmd.add_argument(
        "--source",
        type=Path,
        metavar="DIR",
        help="build from your own llama.cpp checkout or source tarball instead (the patches applied to a copy; "
        "CMAKE_ARGS as usual); the last build made is the one serve uses",
    )


def run(args: argparse.Namespace) -> int:
    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    if args.forget_cpu_verdicts:
        from adaptive_spec.llama.launch import verdict_store

        store = verdict_store()
        say(f"forgot {store.forget()} CPU verdicts ({store.path})")
        return 0
    if args.show:
        found = build.find_built()
        if found is None:
            say("no patched llama-server built yet: adaptive-spec build-server")
            return 1
        state = "current" if found.current else f"{found.stale}: run adaptive-spec build-server"
        print(f"{found.binary}\n  {found.manifest.describe()} ({state})")
        print(f"  {_repack_line(str(found.binary))}")
        return 0
    if args.check:
        root = build.root_dir()
        root.mkdir(parents=True, exist_ok=True)
        check_patches(build.fetch_sdist(root, say=say))
        say(f"{len(build.shipped_patches())} patches apply to {build.SDIST_FILE}")
        return 0
    build.root_dir().mkdir(parents=True, exist_ok=True)
    if args.source is not None:
        from adaptive_spec.llama.binary.source import build_from_source

        found = build_from_source(args.source, jobs=args.jobs, force=args.force, say=say)
    else:
        found = build.build(jobs=args.jobs, force=args.force, say=say)
    if args.print_path:
        print(found.binary)
    else:
        say(f"llama-server: {found.binary}\n  {found.manifest.describe()}")
    return 0


def check_patches(sdist: Path, patches: Sequence[build.Patch] | None = None) -> None:
    """Apply every patch (the shipped ones by default), in order, to a scratch copy of the files they touch in the
    sdist; raises BuildError naming the first that does not apply."""
    patches = build.shipped_patches() if patches is None else patches
    touched = sorted({f for p in patches for f in p.touched_files()})
    with tempfile.TemporaryDirectory() as tmp:
        source = build.extract_source(sdist, Path(tmp), only=touched)
        # Applied for real in a scratch copy: a later patch's context may rely on an earlier one's lines.
        build.apply_patches(source, patches)


def _repack_line(binary: str) -> str:
    """What this machine remembers about running `binary`'s CPU kernels, and how to clear it."""
    from adaptive_spec.llama.launch import verdict_store

    store = verdict_store()
    verdict = store.get(binary)
    if verdict is None:
        return f"CPU weight repacking: on (no fault remembered on {store.cpu_model})"
    return f"runs with {verdict.describe()}\n  {CLEAR_HINT}\n  {REPACK_COST}"
