"""`serve`'s options for moving KV between hosts: the kv-relay beside each attached server, and their key."""

from __future__ import annotations

import argparse
from urllib.parse import urlsplit

from adaptive_spec.access.keys import KeyOption
from adaptive_spec.errors import ConfigError
from adaptive_spec.kv.movers import RelayMoverSettings

KEY_ENV = "ADAPTIVE_SPEC_RELAY_KEY"  # the variable kv-relay itself reads
RELAY_KEY = KeyOption(KEY_ENV, file_flag="--relay-key-file")


def add_relay_arguments(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("KV moves between hosts (README: Replica pools)")
    group.add_argument(
        "--relay",
        action="append",
        default=[],
        metavar="SERVER_URL=RELAY_URL",
        help="the kv-relay beside an attached llama-server (repeatable): sessions moving between servers with relays "
        "take their KV along",
    )
    RELAY_KEY.add_arguments(group, file_help=f"the relays' key (also: ${KEY_ENV})")


def _url(text: str, whole: str) -> str:
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ConfigError(f"--relay {whole!r}: {text!r} is not an http(s) URL")
    return text.rstrip("/")


def relay_settings(args: argparse.Namespace) -> RelayMoverSettings | None:
    if not args.relay:
        return None
    if not args.profile:
        raise ConfigError("--relay is for attached profiles (--profile NAME=URL)")
    pairs: dict[str, str] = {}
    for item in args.relay:
        server, sep, relay = item.partition("=")
        if not sep:
            raise ConfigError(f"--relay {item!r}: expected SERVER_URL=RELAY_URL")
        server, relay = _url(server, item), _url(relay, item)
        if server in pairs:
            raise ConfigError(f"--relay: {server} is given twice")
        pairs[server] = relay
    key = RELAY_KEY.read(args)
    if key is None:
        raise ConfigError(f"--relay needs the relays' key: --relay-key-file FILE or ${KEY_ENV}")
    return RelayMoverSettings(tuple(pairs.items()), key)
