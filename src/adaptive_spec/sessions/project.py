"""Which project a request belongs to: the /p/<project> prefix, an API key's project, the workspace the agent
reveals, the session's project, else `default`."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

import orjson

from adaptive_spec.sessions.messages import message_text, messages_of

DEFAULT_PROJECT = "default"
_CWD_TAG = re.compile(r"<cwd>\s*([^<\n]+?)\s*</cwd>")
_WORKDIR_LINE = re.compile(
    r"^\s*(?:Working directory|Current working directory|cwd)\s*:\s*(\S[^\n]*?)\s*$", re.I | re.M
)
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")
_SCAN_CHARS = 200_000  # system prompts are long; the workspace line is near the top


def project_name(path: str) -> str | None:
    """A workspace path's last component, made safe for a file name and a metrics label."""
    path = path.strip().strip("\"'`")
    if not path:
        return None
    name = (PureWindowsPath(path) if "\\" in path else PurePosixPath(path)).name
    name = _SAFE.sub("-", name).strip("-.")
    return name[:64] or None


def _clean_path(path: str) -> str | None:
    path = path.strip().strip("\"'`").strip()
    return path or None


def _prompt_texts(body: Mapping[str, Any]) -> Iterator[str]:
    """The texts that may name the workspace, first to last; lazily, as a prompt can be long."""
    for message in messages_of(body)[:4]:
        if message.get("role") in ("system", "developer", "user"):
            yield message_text(message.get("content"))
    for key in ("instructions", "system"):  # Responses API / Anthropic put the system prompt here
        yield message_text(body.get(key))


def workspace_path_from_request(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    """The whole workspace path an agent reveals (Codex's turn-metadata header, a <cwd> tag, or a `Working
    directory:` line), for finding a policy file in the workspace when the proxy runs on the same machine."""
    meta = headers.get("x-codex-turn-metadata")
    if meta:
        try:
            parsed = orjson.loads(meta)
        except orjson.JSONDecodeError:
            parsed = None
        workspaces = parsed.get("workspaces") if isinstance(parsed, dict) else None
        if isinstance(workspaces, dict) and workspaces:
            return _clean_path(str(next(iter(workspaces))))
    for text in _prompt_texts(body):
        found = _scanned(text)
        if found:
            return found
    return None


def _scanned(text: str) -> str | None:
    """The workspace path a text names, if any; remembered by the text's length and hash, as an agent sends the same
    system prompt every turn (the hash is kept by the string: the request's message keys reuse it)."""
    key = (len(text), hash(text))
    if key in _SCANS:
        return _SCANS[key]
    found = None
    for pattern in (_CWD_TAG, _WORKDIR_LINE):
        match = pattern.search(text[:_SCAN_CHARS])
        if match:
            found = _clean_path(match.group(1))
            break
    if len(_SCANS) >= _MAX_SCANS:
        del _SCANS[next(iter(_SCANS))]  # the oldest
    _SCANS[key] = found
    return found


_SCANS: dict[tuple[int, int], str | None] = {}
_MAX_SCANS = 1024


def workspace_from_request(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    """The project name of the workspace an agent reveals: the path's last component."""
    path = workspace_path_from_request(headers, body)
    return project_name(path) if path else None


_UNSET = object()


def resolve_project(
    path_project: str | None,
    api_key: str | None,
    key_projects: Mapping[str, str],
    headers: Mapping[str, str],
    body: Mapping[str, Any],
    session_project: str | None,
    *,
    workspace_path: str | object | None = _UNSET,
) -> tuple[str, str]:
    """(project, how it was found). `workspace_path`: the request's workspace when the caller has already looked."""
    if path_project:
        return path_project, "path"
    if api_key and api_key in key_projects:
        return key_projects[api_key], "api-key"
    if workspace_path is _UNSET:
        workspace = workspace_from_request(headers, body)
    else:
        workspace = project_name(workspace_path) if isinstance(workspace_path, str) else None
    if workspace:
        return workspace, "workspace"
    if session_project:
        return session_project, "session"
    return DEFAULT_PROJECT, "default"
