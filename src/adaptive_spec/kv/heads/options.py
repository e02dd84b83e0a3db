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
    build = build_identity(binary)
    if changing := kv_changing_arguments(extra_args):
        build += "|" + " ".join(changing)
    return replace(config, build=build, cache_types=(cache_type_k(extra_args), _cache_type_v(extra_args)))


# llama-server options that change what a slot's KV holds for the same tokens: adapters and control vectors, the
# positional encoding's scaling, tensor overrides, the sliding window's cache. A head saved under one is not another's.
_KV_CHANGING = {  # each with the number of values it takes
    "--lora": 1,
    "--lora-scaled": 2,
    "--control-vector": 1,
    "--control-vector-scaled": 2,
    "--control-vector-layer-range": 2,
    "--override-kv": 1,
    "--rope-scaling": 1,
    "--rope-scale": 1,
    "--rope-freq-base": 1,
    "--rope-freq-scale": 1,
    "--yarn-orig-ctx": 1,
    "--yarn-ext-factor": 1,
    "--yarn-attn-factor": 1,
    "--yarn-beta-slow": 1,
    "--yarn-beta-fast": 1,
    "--swa-full": 0,
}


def kv_changing_arguments(extra_args: Sequence[str]) -> list[str]:
    """The launch arguments among `_KV_CHANGING`, with their values, as given (`--flag value` or `--flag=value`)."""
    args, out = list(extra_args), []
    for i, arg in enumerate(args):
        flag = arg.partition("=")[0]
        if flag not in _KV_CHANGING:
            continue
        n = 0 if "=" in arg else _KV_CHANGING[flag]
        out.append(" ".join(args[i : i + 1 + n]))
    return out


def _cache_type_v(extra_args: Sequence[str]) -> str:
    """The V cache type a server is launched with (`-ctv`), f16 when not named."""
    args = list(extra_args)
    for flag in ("-ctv", "--cache-type-v"):
        if flag in args[:-1]:
            return args[args.index(flag) + 1]
    return "f16"
