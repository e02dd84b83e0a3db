"""`serve`'s access options: the API key (flag, file or environment), Host names, CORS origins, and the refusal to
listen beyond loopback without a key; kv-relay checks its Host names the same way."""

from __future__ import annotations

import argparse

from adaptive_spec.access.keys import KeyOption
from adaptive_spec.access.rules import ANY, AccessPolicy, hosts_for_bind, is_loopback, split_host
from adaptive_spec.errors import ConfigError

KEY_ENV = "ADAPTIVE_SPEC_API_KEY"  # `tui` and `bench` send the key from it too
API_KEY = KeyOption(KEY_ENV, flag="--api-key", file_flag="--api-key-file")


def add_access_arguments(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("access (README: Running it safely)")
    API_KEY.add_arguments(
        group,
        flag_help=f"require this key on every route (also: ${KEY_ENV})",
        file_help="read the key from the file's first line",
    )
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


def allowed_hosts(bind_host: str, allow_host: list[str]) -> tuple[str, ...]:
    """The Host names a server bound to `bind_host` answers to, each `--allow-host` checked (serve and kv-relay)."""
    for host in allow_host:
        if host != ANY and split_host(host) is None:
            raise ConfigError(f"--allow-host {host!r}: expected NAME or NAME:PORT (IPv6 in brackets), or '*'")
    return hosts_for_bind(bind_host, tuple(allow_host))


def access_policy(args: argparse.Namespace, project_keys: list[str]) -> AccessPolicy:
    """The policy for `serve`; refuses to listen beyond loopback without a key unless insisted on."""
    key = API_KEY.read(args)
    hosts = allowed_hosts(args.host, args.allow_host)
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
        allowed_hosts=hosts,
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
