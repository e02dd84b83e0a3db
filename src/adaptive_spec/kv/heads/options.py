"""`serve`'s options for the head store (warm starts): where it lives, how large it may grow, or none at all."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from adaptive_spec.errors import ConfigError
from adaptive_spec.kv.heads.matching import DEFAULT_MAX_BYTES
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
    directory = config.directory or default_dir
    config = replace(
        config,
        directory=directory,
        project_keys=dict(project_keys or {}),
        digests=directory / ".model-sha256.json",  # each model file read whole once, not at each start
    )
    if binary is None:
        return config
    build = build_identity(binary)
    if changing := kv_changing_arguments(extra_args):
        build += "|" + " ".join(changing)
    return replace(config, build=build, cache_types=(cache_type_k(extra_args), _cache_type_v(extra_args)))


# llama-server options known NOT to change what a slot's KV holds for the same tokens (each with the number of values
# it takes): where the server listens and logs, how many threads and slots, batch sizes, timeouts, the web UI, metrics,
# sampling defaults, the slot directory. Any other argument (an adapter, a control vector, rope or YaRN scaling, a
# tensor override, the sliding window's cache, one this list does not know) is part of a head's key.
_KV_NEUTRAL = {
    "--host": 1, "--port": 1, "-t": 1, "--threads": 1, "-tb": 1, "--threads-batch": 1, "--threads-http": 1,
    "-np": 1, "--parallel": 1, "-c": 1, "--ctx-size": 1, "-b": 1, "--batch-size": 1, "-ub": 1, "--ubatch-size": 1,
    "--timeout": 1, "--metrics": 0, "--slots": 0, "--no-slots": 0, "--slot-save-path": 1, "--no-webui": 0,
    "--jinja": 0, "-a": 1, "--alias": 1, "--log-disable": 0, "--log-file": 1, "--log-verbosity": 1, "-lv": 1,
    "--log-colors": 1, "--log-prefix": 0, "--log-timestamps": 0, "--verbose": 0, "-v": 0, "--cache-ram": 1,
    "-cram": 1, "--temp": 1, "--top-k": 1, "--top-p": 1, "--min-p": 1, "--seed": 1, "-s": 1, "--n-predict": 1,
    "-n": 1, "--reasoning-format": 1, "--reasoning-budget": 1, "--cont-batching": 0, "-cb": 0, "--mlock": 0,
    "--no-mmap": 0, "--prio": 1, "--poll": 1, "--sleep-idle-seconds": 1,
}  # fmt: skip


def kv_changing_arguments(extra_args: Sequence[str]) -> list[str]:
    """The launch arguments not known to leave the KV alone (`_KV_NEUTRAL`), with everything up to the next flag, as
    given (`--flag value` or `--flag=value`): an argument this list does not know is part of the key."""
    args, out, i = list(extra_args), [], 0
    while i < len(args):
        arg = args[i]
        flag = arg.partition("=")[0]
        if flag in _KV_NEUTRAL:
            i += 1 + (0 if "=" in arg else _KV_NEUTRAL[flag])
            continue
        j = i + 1
        while j < len(args) and (not args[j].startswith("-") or args[j][1:2].isdigit()):  # its values (-1 is one)
            j += 1
        out.append(" ".join(args[i:j]))
        i = j
    return out


def _cache_type_v(extra_args: Sequence[str]) -> str:
    """The V cache type a server is launched with (`-ctv`), f16 when not named."""
    args = list(extra_args)
    for flag in ("-ctv", "--cache-type-v"):
        if flag in args[:-1]:
            return args[args.index(flag) + 1]
    return "f16"
