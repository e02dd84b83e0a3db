"""`adaptive-spec tui` and `adaptive-spec serve --tui`: argument parsing and start-up of the app.

`serve --tui` runs the proxy as a child process (`adaptive-spec serve` with the same options) and the TUI in this
one: Textual owns the terminal and its event loop, the proxy keeps its own signal handling and shutdown order (it
stops its llama-servers exactly as when run alone), and everything serve prints — native llama.cpp lines included —
lands in the TUI's log pane instead of scribbling over the screen. The TUI still talks to it over HTTP only.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from adaptive_spec.access.keys import KeyOption
from adaptive_spec.access.options import KEY_ENV
from adaptive_spec.cli.text import add_command

PROXY_KEY = KeyOption(KEY_ENV, flag="--api-key")  # the variable serve reads

EPILOG = """\
examples:
  adaptive-spec tui                                   watch the proxy at http://127.0.0.1:8088
  adaptive-spec tui --url http://127.0.0.1:9000       another port (or host: then give --api-key)
  adaptive-spec serve --tui                           serve the embedded model and watch it in one terminal
  adaptive-spec tui --replay trace.jsonl --speed 10   replay a `serve --trace` file (or a --record file) 10x fast
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    tui = add_command(
        sub,
        "tui",
        "watch draft acceptance, sessions and routing decisions live in the terminal",
        "A live terminal view of a running adaptive-spec proxy: per profile the decode speed and the share of\n"
        "output tokens that came from accepted drafts; per agent session its turns, profile and the router's\n"
        "reasons; pin a session to a profile or restart a profile with one key.",
        EPILOG,
    )
    tui.add_argument("--url", default="http://127.0.0.1:8088", help="the proxy to watch (default: %(default)s)")
    PROXY_KEY.add_arguments(tui, flag_help=f"the proxy's API key, when it requires one (default: ${KEY_ENV} if set)")
    tui.add_argument("--replay", type=Path, metavar="FILE", help="replay a `serve --trace` file or a --record file")
    tui.add_argument("--speed", type=float, default=1.0, help="replay speed: 10 = ten times as fast, 0 = at once")
    tui.add_argument("--record", type=Path, metavar="FILE", help="also write every feed event to FILE (JSONL)")


def run_tui(args: argparse.Namespace) -> int:
    from adaptive_spec.tui.app import make_app

    api_key = PROXY_KEY.read(args)
    if args.replay is not None and not args.replay.is_file():
        print(f"adaptive-spec: error: --replay {args.replay}: no such file", file=sys.stderr)
        return 2
    record = args.record.open("ab") if args.record else None
    try:
        app = make_app(url=args.url, api_key=api_key, replay=args.replay, speed=args.speed, record=record)
        app.run()
    finally:
        if record is not None:
            record.close()
    return 0


def serve_with_tui(argv: Sequence[str], host: str, port: int, api_key: str | None) -> int:
    """Runs `adaptive-spec serve` (argv without --tui) as a child and the TUI on its address, sending `api_key`: the
    key serve reads from the same options."""
    from adaptive_spec.tui.app import make_app

    child_argv = [a for a in argv if a != "--tui"]
    shown_host = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    if ":" in shown_host and not shown_host.startswith("["):
        shown_host = f"[{shown_host}]"
    app = make_app(url=f"http://{shown_host}:{port}", api_key=api_key)
    app.child_argv = [sys.executable, "-m", "adaptive_spec", *child_argv]
    app.run()
    return app.child_exit_code or 0
