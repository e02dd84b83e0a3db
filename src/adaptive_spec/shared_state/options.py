"""`serve`'s options for the state several proxies share: where it is, how long a booking outlives its proxy, how
long sessions are kept."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from urllib.parse import urlsplit

from adaptive_spec.errors import ConfigError
from adaptive_spec.policy.model import REDIS_SCHEMES as SCHEMES


@dataclass(frozen=True, slots=True)
class SharedStateSettings:
    url: str
    lease_s: float = 15.0
    ttl_s: float = 3600.0


def add_shared_state_arguments(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("several proxies (shared sessions, placements and slot bookings)")
    group.add_argument(
        "--shared-state",
        metavar="URL",
        help="share sessions, placements, slot bookings and heads with the other serve processes using this Redis "
        "(redis://HOST:PORT/DB; redis://:PASSWORD@HOST:PORT/DB; rediss:// for TLS); stands over the policy's "
        "[shared_state] table; default: that table's url, else this process alone",
    )
    group.add_argument(
        "--shared-state-lease-s",
        type=float,
        default=15.0,
        help="how long a slot booking outlives a proxy that stopped renewing it (default: %(default)s)",
    )
    group.add_argument(
        "--shared-state-ttl-s",
        type=float,
        default=3600.0,
        help="how long a session's placement and echoes are kept after its last turn (default: %(default)s)",
    )


def shared_state_settings(args: argparse.Namespace) -> SharedStateSettings | None:
    url = args.shared_state
    if not url:
        return None
    scheme = urlsplit(url).scheme
    if scheme not in SCHEMES:
        raise ConfigError(
            f"--shared-state: {scheme or 'no scheme'!r} is not a Redis URL ("
            + ", ".join(s + "://" for s in SCHEMES)
            + ")"
        )
    if args.shared_state_lease_s <= 0 or args.shared_state_ttl_s <= 0:
        raise ConfigError("--shared-state-lease-s and --shared-state-ttl-s must be above 0")
    return SharedStateSettings(url, args.shared_state_lease_s, args.shared_state_ttl_s)
