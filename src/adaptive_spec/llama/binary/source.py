"""The patched llama-server from a user's own llama.cpp (a checkout or a source tarball: their fork, their GPU
backend's `CMAKE_ARGS`): the shipped patches applied to a copy of it, compiled into the cache like the pinned build.

Its identity is `build.build_key` with the tree's hash in place of the sdist's, so one definition covers both; a
patch that does not apply is an error naming the patch, the file and the hunk, and how to serve the tree unpatched.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import subprocess
import tarfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from adaptive_spec.errors import BuildError
from adaptive_spec.llama.binary import pinned as build

# What `patch` answers: its exit status and everything it printed.
PatchRun = Callable[[Sequence[str], Path], tuple[int, str]]

# Top-level entries of a checkout that are not source: git's data and the user's own build folders.
_NOT_SOURCE = re.compile(r"^(\.git|build.*|\.cache|\.ccache)$")
_FAILED_HUNK = re.compile(r"^Hunk #(\d+) FAILED at (\d+)")
_PATCHING = re.compile(r"^(?:patching|checking) file (.+)$")


@dataclass(frozen=True, slots=True)
class FailedHunk:
    file: str
    hunk: int
    line: int


def tree_sha256(source: Path) -> str:
    """A hash of every file under `source` (path and bytes, in path order), skipping git's data and build folders:
    the same tree, checked out or unpacked, has the same hash."""
    h = hashlib.sha256()
    for path in sorted(_source_files(source)):
        rel = path.relative_to(source).as_posix()
        h.update(b"file=" + rel.encode() + b"\0")
        h.update(path.read_bytes() if not path.is_symlink() else b"link=" + str(path.readlink()).encode())
        h.update(b"\0")
    return h.hexdigest()


def _source_files(source: Path) -> list[Path]:
    files = []
    for top in source.iterdir():
        if _NOT_SOURCE.match(top.name):
            continue
        if top.is_dir() and not top.is_symlink():
            files += [p for p in top.rglob("*") if p.is_file() or p.is_symlink()]
        else:
            files.append(top)
    return files


def source_key(tree: str, patches: Sequence[build.Patch], cmake_args: Sequence[str]) -> str:
    return build.build_key(f"tree:{tree}", patches, cmake_args)


def failed_hunks(patch_output: str) -> list[FailedHunk]:
    """The hunks `patch` reports FAILED, each with the file it was patching."""
    current, failed = "?", []
    for line in patch_output.splitlines():
        if m := _PATCHING.match(line.strip()):
            current = m.group(1).strip()
        elif m := _FAILED_HUNK.match(line.strip()):
            failed.append(FailedHunk(current, int(m.group(1)), int(m.group(2))))
    return failed


def not_applying(patch: build.Patch, where: str, hunks: Sequence[FailedHunk], output: str) -> BuildError:
    """The error for a patch that does not apply to a user's tree: which hunks, and how to serve it unpatched."""
    if hunks:
        what = "; ".join(f"{h.file} hunk #{h.hunk} (expected at line {h.line})" for h in hunks)
    else:
        what = output.strip().splitlines()[-1] if output.strip() else "patch failed"
    return BuildError(
        f"{patch.name} does not apply to {where}: {what}. The tree has moved where this patch expects fixed "
        "context (applied at --fuzz=0 on purpose). To serve this tree unpatched, build its llama-server yourself "
        "and run `adaptive-spec serve --llama-server PATH` (the stock fallback: one server per profile, no "
        "speculation per request)."
    )


def _patch_run(argv: Sequence[str], cwd: Path) -> tuple[int, str]:
    try:
        done = subprocess.run(list(argv), cwd=cwd, capture_output=True, text=True, errors="replace", check=False)
    except FileNotFoundError as exc:
        raise BuildError(f"{argv[0]} not found: {exc}") from exc
    return done.returncode, done.stdout + done.stderr


def apply_series(source: Path, patches: Sequence[build.Patch], where: str, patch_run: PatchRun = _patch_run) -> None:
    """Each patch, in order, at --fuzz=0: first a dry run, so a failing one leaves the copy as it was."""
    for p in patches:
        path = source.parent / f".{p.name}"
        path.write_bytes(p.data)
        try:
            argv = ["patch", "-p1", "--forward", "--batch", "--fuzz=0", "--input", str(path)]
            status, output = patch_run([*argv, "--dry-run"], source)
            if status != 0:
                raise not_applying(p, where, failed_hunks(output), output)
            status, output = patch_run(argv, source)
            if status != 0:
                raise not_applying(p, where, failed_hunks(output), output)
        finally:
            path.unlink()


def copy_source(given: Path, dest: Path) -> Path:
    """A scratch copy of the user's tree (a folder, or a .tar.* with one top folder); returns its root."""
    if given.is_dir():
        shutil.copytree(given, dest, symlinks=True, ignore=lambda d, names: _ignored(given, d, names))
        return dest
    if given.is_file() and tarfile.is_tarfile(given):
        with tarfile.open(given) as tar:
            tar.extractall(dest, filter="data")
        tops = [p for p in dest.iterdir()]
        return tops[0] if len(tops) == 1 and tops[0].is_dir() else dest
    raise BuildError(f"{given} is neither a llama.cpp folder nor a source tarball")


def _ignored(root: Path, folder: str, names: list[str]) -> list[str]:
    return [n for n in names if _NOT_SOURCE.match(n)] if Path(folder) == root else []


def build_from_source(
    given: Path,
    root: Path | None = None,
    cmake_args: Sequence[str] | None = None,
    *,
    jobs: int | None = None,
    force: bool = False,
    run: build.Run = build.run_step,
    patch_run: PatchRun = _patch_run,
    say: build.Say = print,
) -> build.Built:
    """The shipped patches applied to a copy of `given`, compiled into the cache and made `current` (the build
    `serve` then uses); a tree, patch set and CMAKE_ARGS built before is not compiled again."""
    root = root or build.root_dir()
    args = tuple(build.cmake_args_from_env() if cmake_args is None else cmake_args)
    patches = build.shipped_patches()
    given = given.resolve()
    if given.is_dir() and not (given / "tools" / "server").is_dir():
        raise BuildError(f"{given} does not look like llama.cpp (no tools/server/ in it)")
    with build.locked(root):
        return _build_locked(given, root, args, patches, jobs, force, run, patch_run, say)


def _build_locked(
    given: Path,
    root: Path,
    args: tuple[str, ...],
    patches: list[build.Patch],
    jobs: int | None,
    force: bool,
    run: build.Run,
    patch_run: PatchRun,
    say: build.Say,
) -> build.Built:
    with build.work_dir(root / "work-source") as work:
        say(f"copying {given} and applying {len(patches)} patches")
        source = copy_source(given, work / "src")
        tree = tree_sha256(source)
        key = source_key(tree, patches, args)
        if not force and (root / key / "build.json").is_file() and (root / key / "llama-server").is_file():
            (root / "current").write_text(key + "\n")
            found = build.find_built(root, patches)
            if found is not None:
                return found
        apply_series(source, patches, str(given), patch_run)
        manifest = build.Manifest(
            key=key,
            llama_cpp="own tree",
            sdist=f"source {given}",
            sdist_sha256=tree,
            patches=tuple(p.name for p in patches),
            patch_sha256=tuple(p.sha256 for p in patches),
            cmake_args=args,
            recipe=build.RECIPE,
            built_unix=0.0,
        )
        return build.compile_and_install(root, work, source, manifest, patches, jobs, run, say)
