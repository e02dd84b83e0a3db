"""Policy files on disk: the shipped default, one file per project in the config dir, and a workspace's own file;
reloaded when they change, keeping the last good version of a file that became invalid."""

from __future__ import annotations

import errno
import os
import re
import stat
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

import platformdirs

from adaptive_spec.common.lru import LRU
from adaptive_spec.policy.model import Overlay, Policy, apply, policy_to_toml_dict
from adaptive_spec.policy.reading import PolicyError, Problem, parse_overlay

SHIPPED = "built-in default.toml"
WORKSPACE_FILE = ".adaptive-spec.toml"
_PROJECT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # as a /p/<project> prefix allows: never a path
_BASE = ("default", None)  # the policy of a request with no project of its own
_MAX_TRACKED = 256  # projects and workspaces come from requests, so what is remembered of them is bounded


def config_dir() -> Path:
    """Where per-project policies live (`<config dir>/policies/<project>.toml`); ADAPTIVE_SPEC_CONFIG_DIR overrides."""
    override = os.environ.get("ADAPTIVE_SPEC_CONFIG_DIR")
    return Path(override) if override else Path(platformdirs.user_config_dir("adaptive-spec"))


def default_policy_text() -> str:
    """The shipped default.toml: every key with its default value and a comment."""
    return resources.files("adaptive_spec").joinpath("policies/default.toml").read_text(encoding="utf-8")


MAX_POLICY_BYTES = 256 * 1024


def _read_small_regular_file(path: Path) -> str:
    """A policy file's text. Workspace paths come from requests: a FIFO, a device or a huge file there must not
    block or flood the proxy, so only a regular file of at most MAX_POLICY_BYTES is read, without blocking."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if info.st_size > MAX_POLICY_BYTES:
            raise OSError(errno.EFBIG, f"larger than {MAX_POLICY_BYTES} bytes")
        data = os.read(fd, MAX_POLICY_BYTES + 1)
    finally:
        os.close(fd)
    return data.decode("utf-8")


def read_policy_file(path: Path, label: str, known_profiles: Collection[str] | None) -> tuple[Overlay, list[Problem]]:
    """The overlay of one file and its problems; a file that cannot be read is one problem, not an exception."""
    try:
        text = _read_small_regular_file(path)
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return {}, [Problem(label, "", None, f"cannot read the file: {reason}")]
    return parse_overlay(text, label, known_profiles)


def check_files(files: Collection[Path], known_profiles: Collection[str] | None) -> list[tuple[str, list[Problem]]]:
    """(file, its problems) for each file; with no files, every file a proxy on this machine would read: the shipped
    default, the config dir's project files and the current folder's workspace file."""
    if files:
        return [(str(p), read_policy_file(p, str(p), known_profiles)[1]) for p in files]
    results = [(SHIPPED, parse_overlay(default_policy_text(), SHIPPED, known_profiles)[1])]
    found = sorted((config_dir() / "policies").glob("*.toml"))
    if Path(WORKSPACE_FILE).is_file():
        found.append(Path(WORKSPACE_FILE))
    return results + [(str(p), read_policy_file(p, str(p), known_profiles)[1]) for p in found]


@dataclass(frozen=True, slots=True)
class _FileState:
    signature: tuple[int, int] | None = None  # (mtime_ns, size) when last read; None = not there
    overlay: Overlay | None = None  # the last version that parsed; None = none ever did (or the file went away)
    problems: tuple[Problem, ...] = ()  # of the version on disk


class _WatchedFile:
    """One policy file, looked at again by `check`, which reads it only when its mtime or size changed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.label = str(path)
        self.state = _FileState()

    def check(self, known_profiles: Collection[str] | None) -> str | None:
        """Look at the file again; a line to log when what it contributes (or what is wrong with it) changed."""
        try:
            stat = self.path.stat()
        except OSError:
            if self.state.signature is None:
                return None
            dropped = self.state.overlay is not None
            self.state = _FileState()
            return f"policy {self.label} was removed" + ("; its settings no longer apply" if dropped else "")
        signature = (stat.st_mtime_ns, stat.st_size)
        if signature == self.state.signature:
            return None
        overlay, problems = read_policy_file(self.path, self.label, known_profiles)
        before = self.state
        if problems:
            self.state = replace(before, signature=signature, problems=tuple(problems))
            keeping = "keeping the last good version" if before.overlay is not None else "not applying it"
            return f"policy {self.label} is invalid, {keeping}: {'; '.join(str(p) for p in problems)}"
        self.state = _FileState(signature, overlay)
        return f"policy {self.label} {'reloaded' if before.signature is not None else 'loaded'}"


def _quiet(message: str) -> None:
    """The default log: the messages are also returned by `PolicyStore.refresh`."""


class PolicyStore:
    """The policy of each (project, workspace), from built-in defaults ← the base file ← the project's file ← the
    workspace's file. `policy_for` runs on every generating request and answers from an immutable snapshot that is
    swapped in whole, and nothing else: it reads no file and takes no lock. Files are read only at startup (the base
    policy, published before any request), by `load` (a project or workspace seen for the first time) and by
    `refresh` (every few seconds); the proxy runs both in a thread, never on its event loop (`known` says whether a
    request needs a `load` first)."""

    def __init__(
        self,
        base_file: Path | None,
        known_profiles: Collection[str] | None,
        config_dir: Path,
        read_workspace_files: bool = True,
        log: Callable[[str], None] = _quiet,
    ) -> None:
        self._known = frozenset(known_profiles) if known_profiles is not None else None  # None: names unchecked
        self._projects_dir = config_dir / "policies"
        self._read_workspace_files = read_workspace_files
        self._log = log
        self._lock = threading.Lock()
        self._pending: list[str] = []  # logged outside refresh, returned by the next one
        self._projects: LRU[str, _WatchedFile | None] = LRU(_MAX_TRACKED)
        self._workspaces: LRU[str, _WatchedFile | None] = LRU(_MAX_TRACKED)
        # Never changed once published: readers on the event loop take it without the lock.
        self._snapshot: Mapping[tuple[str, str | None], Policy] = MappingProxyType({})
        self._stale = False  # a watched file was dropped from the tables: the next snapshot starts afresh
        self._shipped: Overlay | None = None
        self._base: _WatchedFile | None = None
        if base_file is None:
            self._shipped, problems = parse_overlay(default_policy_text(), SHIPPED, self._known)
        else:
            self._base = _WatchedFile(base_file)
            loaded = self._base.check(self._known)
            problems = list(self._base.state.problems)
            if self._base.state.signature is None:  # not there: let the read say why
                problems = read_policy_file(base_file, str(base_file), self._known)[1]
            if not problems:
                self._note(loaded)
        if problems:
            raise PolicyError(problems)  # at startup a bad base file stops the proxy, with every problem listed
        # The base policy is always published: `policy_for` answers it for a pair not loaded yet.
        self._snapshot = MappingProxyType({_BASE: self._merge(self._files_of(*_BASE))})

    def _key(self, project: str, workspace: str | None) -> tuple[str, str | None]:
        return (project, workspace if self._read_workspace_files else None)

    def known(self, project: str, workspace: str | None) -> bool:
        """Whether the snapshot holds this pair's own policy (else `load` it, off the event loop)."""
        return self._key(project, workspace) in self._snapshot

    def policy_for(self, project: str, workspace: str | None) -> Policy:
        """The effective policy of a request, from the snapshot alone (no file, no lock): a pair not loaded yet, or
        dropped from the snapshot since (its files no longer watched), gets the base policy until it is `load`ed."""
        snapshot = self._snapshot  # one read: a thread may swap it meanwhile
        policy = snapshot.get(self._key(project, workspace))
        return policy if policy is not None else snapshot[_BASE]

    def load(self, project: str, workspace: str | None) -> Policy:
        """Read a (project, workspace)'s files the first time (file I/O) and publish its policy in a new snapshot."""
        key = self._key(project, workspace)
        with self._lock:
            policy = self._merge(self._files_of(*key))
            fresh = self._stale or len(self._snapshot) >= 4 * _MAX_TRACKED
            kept: Mapping[tuple[str, str | None], Policy] = self._snapshot
            if fresh:  # the base stays in every snapshot
                kept = {_BASE: self._merge(self._files_of(*_BASE))}
            self._stale = False
            self._snapshot = MappingProxyType({**kept, key: policy})
        return policy

    def refresh(self) -> list[str]:
        """Look at every known file again (file I/O); the lines logged since the last refresh (to publish as
        events). When anything changed, every known policy is merged again into a new snapshot."""
        with self._lock:
            messages, self._pending = self._pending, []
            changed = [m for f in self._all_files() if (m := f.check(self._known))]
            if changed or self._stale:
                # The base policy stays published: the router reads it on the event loop after a refresh.
                keys = {_BASE, *([] if self._stale else self._snapshot)}
                self._stale = False
                self._snapshot = MappingProxyType({k: self._merge(self._files_of(*k)) for k in keys})
            for message in changed:  # said once the new snapshot is in force: "reloaded" means it applies
                self._log(message)
        return messages + changed

    def problems(self) -> list[Problem]:
        """What is wrong with the files on disk now (their last good versions still apply)."""
        with self._lock:
            return [p for f in self._all_files() for p in f.state.problems]

    def describe(self, project: str, workspace: str | None) -> dict[str, Any]:
        """The effective policy of a (project, workspace), the files it came from, and what is wrong with them (file
        I/O for a pair not loaded yet: it is loaded)."""
        policy = (
            self.policy_for(project, workspace) if self.known(project, workspace) else self.load(project, workspace)
        )
        with self._lock:
            files = [self._base, *self._files_of(project, workspace if self._read_workspace_files else None)]
            problems = [str(p) for f in files if f is not None for p in f.state.problems]
        return {"policy": policy_to_toml_dict(policy), "sources": list(policy.sources), "problems": problems}

    def _note(self, message: str | None) -> None:
        if message:
            self._log(message)
            self._pending.append(message)
            del self._pending[:-_MAX_TRACKED]  # bounded even if nobody calls refresh

    def _all_files(self) -> Iterator[_WatchedFile]:
        if self._base is not None:
            yield self._base
        yield from (f for f in self._projects.values() if f is not None)
        yield from (f for f in self._workspaces.values() if f is not None)

    def _files_of(self, project: str, workspace: str | None) -> list[_WatchedFile | None]:
        """The project's and the workspace's files (None where there can be none); the first sight of either is
        remembered, so `refresh` also notices a file that is created later."""
        project_file = self._track(self._projects, project, self._project_path)
        workspace_file = self._track(self._workspaces, workspace, _workspace_path) if workspace else None
        return [project_file, workspace_file]

    def _track(
        self, table: LRU[str, _WatchedFile | None], key: str, path_of: Callable[[str], Path | None]
    ) -> _WatchedFile | None:
        if key in table:
            table.touch(key)
            return table.get(key)
        path = path_of(key)
        watched = _WatchedFile(path) if path is not None else None
        if watched is not None:
            self._note(watched.check(self._known))
        if table.put(key, watched):
            self._stale = True  # a published policy of a file no longer watched would never see its changes
        return watched

    def _project_path(self, project: str) -> Path | None:
        return self._projects_dir / f"{project}.toml" if _PROJECT.match(project) else None

    def _merge(self, files: list[_WatchedFile | None]) -> Policy:
        policy = Policy()
        if self._shipped is not None:
            policy = apply(policy, self._shipped, SHIPPED)
        for watched in (self._base, *files):
            if watched is not None and watched.state.overlay is not None:
                policy = apply(policy, watched.state.overlay, watched.label)
        return policy


def _workspace_path(workspace: str) -> Path | None:
    """The workspace's policy file, only for a workspace on this machine: an agent elsewhere reveals paths that mean
    nothing here, or something else."""
    folder = Path(workspace)
    return folder / WORKSPACE_FILE if folder.is_absolute() and folder.is_dir() else None
