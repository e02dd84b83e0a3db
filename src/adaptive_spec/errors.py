"""The one exception root of adaptive-spec, with a subclass per domain; `cli.main` turns them into exit codes."""

from __future__ import annotations


class AdaptiveSpecError(Exception):
    """Base of every error adaptive-spec raises on purpose; its message is meant for a person."""

    exit_code = 1


class ConfigError(AdaptiveSpecError):
    """Bad command-line arguments or settings."""

    exit_code = 2


class ModelError(AdaptiveSpecError):
    """A model file cannot be found, assembled or verified."""


class LaunchError(AdaptiveSpecError):
    """A llama-server profile could not be started or became unhealthy during start-up."""


class ProfileMismatchError(AdaptiveSpecError):
    """Profiles serve different models, so a session could not move between them."""


class BuildError(AdaptiveSpecError):
    """The patched llama-server could not be downloaded, patched or compiled."""
