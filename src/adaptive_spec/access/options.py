"""`serve`'s access options: the API key (flag, environment, file), Host names, CORS origins, and the refusal to
listen beyond loopback without a key."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from adaptive_spec.access.policy import ANY, AccessPolicy, hosts_for_bind, is_loopback, split_host
from adaptive_spec.errors import ConfigError

KEY_ENV = "ADAPTIVE_SPEC_API_KEY"


def add_access_arguments(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("access (README: Running it safely)")
    group.add_argument("--api-key", metavar="KEY", help=f"require this key on every route (also: ${KEY_ENV})")
    group.add_argument("--api-key-file", type=Path, metavar="FILE", help="read the key from the file's first line")
    group.add_argument("--forward-api-key", action="store_true", help="also send the client's key on to llama-server")
    group.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME[:PORT]",
        help="a Host name clients use besides localhost, 127.0.0.1 and [::1] (repeatable; '*': any, no DNS-rebinding "
        "protection)",
    )
    group.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a web page origin (https://app.example) allowed to call the proxy from a browser (repeatable)",
    )
    group.add_argument(
        "--allow-profile-control",
        action="store_true",
        help="pass llama-server's slot actions, model loading and setting changes through (refused by default)",
    )
    group.add_argument(
        "--insecure-no-key", action="store_true", help="listen beyond loopback without an API key anyway"
    )


def api_key(args: argparse.Namespace) -> str | None:
    """The key serve requires: from --api-key, --api-key-file or the environment (None: no key)."""
    if args.api_key and args.api_key_file:
        raise ConfigError("--api-key and --api-key-file: give one of them")
    if args.api_key_file:
        try:
            lines = args.api_key_file.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ConfigError(f"--api-key-file {args.api_key_file}: {exc.strerror or exc}") from exc
        key = lines[0].strip() if lines else ""
        if not key:
            raise ConfigError(f"--api-key-file {args.api_key_file}: the first line is empty")
        return key
    key = args.api_key or os.environ.get(KEY_ENV, "").strip()
    return key or None


def access_policy(args: argparse.Namespace, project_keys: list[str]) -> AccessPolicy:
    """The policy for `serve`; refuses to listen beyond loopback without a key unless insisted on."""
    key = api_key(args)
    for host in args.allow_host:
        if host != ANY and split_host(host) is None:
            raise ConfigError(f"--allow-host {host!r}: expected NAME or NAME:PORT (IPv6 in brackets), or '*'")
    if key is None and not is_loopback(args.host) and not args.insecure_no_key:
        raise ConfigError(
            f"--host {args.host} lets other machines reach the proxy, and no API key is set: anyone who can reach "
            f"the port could use the model and restart profiles. Set a key with --api-key-file FILE, ${KEY_ENV} "
            "or --api-key KEY (clients send it as 'Authorization: Bearer KEY'), or pass --insecure-no-key to serve "
            "without one."
        )
    # One key model: with a key required, each --project-key key is accepted too (and names its project).
    keys = (key, *project_keys) if key is not None else ()
    return AccessPolicy(
        api_keys=tuple(dict.fromkeys(keys)),
        allowed_hosts=hosts_for_bind(args.host, tuple(args.allow_host)),
        cors_origins=tuple(args.cors_origin),
        forward_api_key=args.forward_api_key,
        allow_profile_control=args.allow_profile_control,
    )


def describe_access(policy: AccessPolicy) -> str:
    """The start-up line saying which protections are on."""
    if policy.keys_required:
        key = f"API key required ({len(policy.api_keys)} accepted" + (
            ", sent on to llama-server)" if policy.forward_api_key else ", not sent on to llama-server)"
        )
    else:
        key = "no API key"
    hosts = (
        "any Host (no DNS-rebinding check)"
        if ANY in policy.allowed_hosts
        else ("Host " + ", ".join(policy.allowed_hosts))
    )
    cors = ("CORS for " + ", ".join(policy.cors_origins)) if policy.cors_origins else "no CORS"
    control = "slot actions passed through" if policy.allow_profile_control else "slot actions refused"
    return f"access: {key}; {hosts}; {cors}; {control}"
