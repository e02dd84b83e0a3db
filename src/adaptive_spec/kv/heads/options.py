"""`serve`'s options for the head store (warm starts): where it lives, how large it may grow, or none at all."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from adaptive_spec.errors import ConfigError
from adaptive_spec.kv.heads.plan import DEFAULT_MAX_BYTES
from adaptive_spec.kv.heads.store import HeadsConfig
from adaptive_spec.servers.cpu_faults import build_identity
from adaptive_spec.servers.footprint import cache_type_k


def add_heads_arguments(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("warm starts: agents' heads kept across sessions and restarts")
    group.add_argument(
        "--heads-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where heads (slot files of sessions' first turns) are kept (default: heads/ in the state directory)",
    )
    group.add_argument(
        "--heads-max-gb",
        type=float,
        default=DEFAULT_MAX_BYTES / 1024**3,
        metavar="GB",
        help="the store's bound in GiB; the least recently used heads go first (default: %(default)s)",
    )
    group.add_argument("--no-heads", action="store_true", help="keep no heads: every new session prefills its own")


def heads_config(args: argparse.Namespace) -> HeadsConfig | None:
    if args.no_heads:
        return None
    if not args.heads_max_gb > 0:
        raise ConfigError(f"--heads-max-gb {args.heads_max_gb}: must be above 0")
    directory = args.heads_dir.expanduser() if args.heads_dir is not None else None  # None: the state directory's
    return HeadsConfig(directory, int(args.heads_max_gb * 1024**3))


def launched_heads(
    config: HeadsConfig,
    default_dir: Path,
    binary: str | None,
    extra_args: Sequence[str] = (),
    project_keys: bool = False,
) -> HeadsConfig:
    """The store's config for this run: its directory resolved, and what `serve` knows of the servers it launches
    (the binary's identity, the KV cache type) for the key a head is valid under. Attached servers (`binary` None)
    are known by what they report. With `--project-key` projects are tenants: a head is shared within one only."""
    config = replace(config, directory=config.directory or default_dir, per_project=project_keys)
    if binary is None:
        return config
    return replace(config, build=build_identity(binary), kv_type=cache_type_k(extra_args))
