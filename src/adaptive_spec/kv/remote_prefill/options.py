"""`serve`'s remote prefill options (`--pp-server` and how it is priced)."""

from __future__ import annotations

import argparse

from adaptive_spec.access.keys import KeyOption
from adaptive_spec.errors import ConfigError
from adaptive_spec.kv.remote_prefill.pricing import RemotePrefillPolicy
from adaptive_spec.kv.remote_prefill.shell import RemotePrefillSettings
from adaptive_spec.kv.slot_files import valid_sha256

KEY_ENV = "ADAPTIVE_SPEC_PP_KEY"
PP_KEY = KeyOption(KEY_ENV, file_flag="--pp-key-file")


def add_pp_arguments(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("remote prefill (README: Remote prefill)")
    group.add_argument("--pp-server", metavar="URL", help="the kv-relay beside a bigger machine's llama-server")
    PP_KEY.add_arguments(group, file_help=f"the relay's key (also: ${KEY_ENV})")
    group.add_argument("--pp-model-sha256", metavar="HEX", help="this side's GGUF sha256 when the proxy cannot read it")
    defaults = RemotePrefillPolicy()
    group.add_argument(
        "--pp-min-tokens", type=int, default=defaults.min_tokens, help="fewer new prompt tokens stay here (%(default)s)"
    )
    group.add_argument(
        "--pp-prefill-tps",
        type=float,
        default=defaults.remote_prefill_tps,
        help="the remote's prefill speed until measured (tokens/s, %(default)s)",
    )
    group.add_argument(
        "--pp-margin", type=float, default=defaults.margin, help="remote must be this much faster (%(default)s)"
    )
    group.add_argument("--pp-always", action="store_true", help="prefill remotely whenever possible (testing)")


def pp_settings(args: argparse.Namespace) -> RemotePrefillSettings | None:
    if not args.pp_server:
        return None
    key = PP_KEY.read(args)
    if key is None:
        raise ConfigError(f"--pp-server needs the relay's key: --pp-key-file FILE or ${KEY_ENV}")
    sha = args.pp_model_sha256.lower() if args.pp_model_sha256 else None
    if sha is not None and not valid_sha256(sha):
        raise ConfigError("--pp-model-sha256: 64 hex digits (sha256sum of the GGUF)")
    if args.pp_min_tokens < 0 or args.pp_prefill_tps <= 0 or args.pp_margin < 0:
        raise ConfigError("--pp-min-tokens >= 0, --pp-prefill-tps > 0 and --pp-margin >= 0")
    policy = RemotePrefillPolicy(
        min_tokens=args.pp_min_tokens,
        margin=args.pp_margin,
        force=args.pp_always,
        remote_prefill_tps=args.pp_prefill_tps,
    )
    return RemotePrefillSettings(args.pp_server.rstrip("/"), key, policy, sha)
