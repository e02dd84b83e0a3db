"""`serve`'s options for slow and idle clients: how long a client may take to send a request, how long an idle
connection is kept, and how many connections are held at once (`proxy/connection_book.py` enforces them)."""

from __future__ import annotations

import argparse

from adaptive_spec.errors import ConfigError
from adaptive_spec.proxy.connection_book import ConnectionLimits

_CONNECTIONS = ConnectionLimits()


def add_connection_arguments(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("slow and idle clients (answers, however long, are never cut)")
    group.add_argument(
        "--header-timeout",
        type=float,
        default=_CONNECTIONS.header_timeout_s,
        metavar="S",
        help="seconds a client may take to send a request's headers, from connecting (on a kept-alive connection: "
        "from the next request's first byte); then the connection is closed (default: %(default)s)",
    )
    group.add_argument(
        "--body-timeout",
        type=float,
        default=_CONNECTIONS.body_timeout_s,
        metavar="S",
        help="seconds a client may take to send a request's body once its headers are in (default: %(default)s)",
    )
    group.add_argument(
        "--keepalive-timeout",
        type=float,
        default=_CONNECTIONS.keepalive_timeout_s,
        metavar="S",
        help="seconds an idle keep-alive connection is kept (default: %(default)s)",
    )
    group.add_argument(
        "--max-connections",
        type=int,
        default=_CONNECTIONS.max_connections,
        metavar="N",
        help="client connections held at once; past it the one that has been sending its request the longest, else "
        "the longest idle one, is closed, never one being answered (default: %(default)s; lowered to what "
        "ulimit -n allows)",
    )


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    for flag, value in (
        ("--header-timeout", args.header_timeout),
        ("--body-timeout", args.body_timeout),
        ("--keepalive-timeout", args.keepalive_timeout),
        ("--max-connections", args.max_connections),
    ):
        if not value > 0:
            raise ConfigError(f"{flag} {value}: must be more than 0")
    return ConnectionLimits(args.header_timeout, args.body_timeout, args.keepalive_timeout, args.max_connections)
