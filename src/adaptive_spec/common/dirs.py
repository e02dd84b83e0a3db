"""Where adaptive-spec keeps what it builds and assembles (one cache directory: $ADAPTIVE_SPEC_CACHE_DIR, else the
platform's user cache dir) and what it learns and runs in (one state directory: $ADAPTIVE_SPEC_STATE_DIR, else the
platform's user state dir), each read in one place so no two features disagree on it."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def cache_dir() -> Path:
    override = os.environ.get("ADAPTIVE_SPEC_CACHE_DIR")
    return Path(override) if override else Path(platformdirs.user_cache_dir("adaptive-spec"))


def state_dir() -> Path:
    override = os.environ.get("ADAPTIVE_SPEC_STATE_DIR")
    return Path(override) if override else Path(platformdirs.user_state_dir("adaptive-spec"))
