"""`serve`'s options for the head store (warm starts): where it lives, how large it may grow, or none at all."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from adaptive_spec.errors import ConfigError
from adaptive_spec.kv.heads.plan import DEFAULT_MAX_BYTES
from adaptive_spec.kv.heads.values import HeadsConfig
from adaptive_spec.llama.binary.cpu_faults import build_identity
from adaptive_spec.llama.memory.footprint import cache_type_k


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
    project_keys: Mapping[str, str] | None = None,
) -> HeadsConfig:
    """The store's config for this run: its directory resolved, and what `serve` knows of the servers it launches
    (the binary's identity, the K and V cache types) for the key a head is valid under. Attached servers (`binary`
    None) are known by what they report. With `--project-key` projects are tenants: a head is shared within the
    project of the key a request was sent with only."""
    config = replace(config, directory=config.directory or default_dir, project_keys=dict(project_keys or {}))
    if binary is None:
        return config
    return replace(
        config, build=build_identity(binary), cache_types=(cache_type_k(extra_args), _cache_type_v(extra_args))
    )


def _cache_type_v(extra_args: Sequence[str]) -> str:
    """The V cache type a server is launched with (`-ctv`), f16 when not named."""
    args = list(extra_args)
    for flag in ("-ctv", "--cache-type-v"):
        if flag in args[:-1]:
            return args[args.index(flag) + 1]
    return "f16"
