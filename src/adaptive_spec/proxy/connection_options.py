"""`serve`'s options for slow and idle clients: how long a client may take to send a request, how long an idle
connection is kept, and how many connections are held at once (`proxy/connection_book.py` enforces them)."""

from __future__ import annotations

import argparse

from adaptive_spec.errors import ConfigError
from adaptive_spec.proxy.connection_book import ConnectionLimits

_CONNECTIONS = ConnectionLimits()
# Each option: its flag, the ConnectionLimits field it sets, its type and metavar, and its help.
_OPTIONS: tuple[tuple[str, str, type, str, str], ...] = (
    (
        "--header-timeout",
        "header_timeout_s",
        float,
        "S",
        "seconds a client may take to send a request's headers, from connecting (on a kept-alive connection: from the "
        "next request's first byte); then the connection is closed (default: %(default)s)",
    ),
    (
        "--body-timeout",
        "body_timeout_s",
        float,
        "S",
        "seconds a client may take to send a request's body once its headers are in (default: %(default)s)",
    ),
    (
        "--keepalive-timeout",
        "keepalive_timeout_s",
        float,
        "S",
        "seconds an idle keep-alive connection is kept (default: %(default)s)",
    ),
    (
        "--max-connections",
        "max_connections",
        int,
        "N",
        "client connections held at once; past it the one that has been sending its request the longest, else the "
        "longest idle one, is closed, never one being answered (default: %(default)s; lowered to what ulimit -n "
        "allows)",
    ),
)


def add_connection_arguments(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("slow and idle clients (answers, however long, are never cut)")
    for flag, name, kind, metavar, text in _OPTIONS:
        group.add_argument(flag, type=kind, default=getattr(_CONNECTIONS, name), metavar=metavar, help=text)


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    """The limits the options give; each must be more than 0."""
    values = {}
    for flag, name, _, _, _ in _OPTIONS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if not value > 0:
            raise ConfigError(f"{flag} {value}: must be more than 0")
        values[name] = value
    return ConnectionLimits(**values)
