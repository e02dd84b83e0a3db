"""`adaptive-spec kv-relay`: argument parsing and start-up of the relay service."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from pathlib import Path

from aiohttp import web

from adaptive_spec.access.keys import KeyOption
from adaptive_spec.access.options import allowed_hosts
from adaptive_spec.access.rules import AccessPolicy
from adaptive_spec.cli.text import add_command
from adaptive_spec.errors import ConfigError
from adaptive_spec.kv.movers_options import KEY_ENV
from adaptive_spec.kv.slot_files import file_sha256
from adaptive_spec.relay.prefill import ROUTES, client_ctx
from adaptive_spec.relay.service import RATE_ENV, RelaySettings, build_relay_app, sweep_partials

RELAY_KEY = KeyOption(KEY_ENV, flag="--key", file_flag="--key-file")
EPILOG = """\
examples:
  on the big machine, beside `llama-server -m model.gguf --port 8080 --slot-save-path /srv/slots`:
  adaptive-spec kv-relay --slot-dir /srv/slots --model model.gguf --server http://127.0.0.1:8080 \\
      --key-file relay.key --host 0.0.0.0 --allow-host ppserver
  and on the small one (same GGUF, its profiles' slot files in a directory of their own):
  adaptive-spec serve --model model.gguf --pp-server http://ppserver:8095 --pp-key-file relay.key
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    relay = add_command(
        sub,
        "kv-relay",
        "serve a llama-server's slot files to other machines (remote prefill, KV moves across hosts)",
        "Runs beside a llama-server: serves and receives its slot files (key required, streamed, sha256-checked,\n"
        "size-bounded, only inside --slot-dir), reports the sha256 of the GGUF it runs, and with --server\n"
        "prefills prompts there for a proxy's `serve --pp-server`.",
        EPILOG,
    )
    relay.add_argument("--slot-dir", type=Path, required=True, help="the llama-server's --slot-save-path")
    relay.add_argument("--model", type=Path, required=True, help="the GGUF the llama-server runs (its sha256 is told)")
    relay.add_argument("--server", metavar="URL", help="the llama-server (for POST /relay/prefill)")
    RELAY_KEY.add_arguments(
        relay,
        flag_help=f"the key callers must send (also: ${KEY_ENV})",
        file_help="read the key from the file's first line",
    )
    relay.add_argument("--host", default="127.0.0.1", help="address to serve on (default: %(default)s)")
    relay.add_argument("--port", type=int, default=8095, help="port to serve on (default: %(default)s)")
    relay.add_argument(
        "--allow-host", action="append", default=[], metavar="NAME[:PORT]", help="a Host name callers use (repeatable)"
    )
    relay.add_argument(
        "--max-bytes", type=int, default=64 << 30, help="largest slot file accepted (default: %(default)s)"
    )
    relay.add_argument("--prefill-timeout", type=float, default=3600.0, help="seconds one prefill may take")


def _key(args: argparse.Namespace) -> str:
    key = RELAY_KEY.read(args)
    if key is None:
        raise ConfigError(f"kv-relay needs a key: --key-file FILE, ${KEY_ENV} or --key KEY (it serves KV caches)")
    return key


def settings_from(args: argparse.Namespace) -> RelaySettings:
    hosts = allowed_hosts(args.host, args.allow_host)
    if not args.slot_dir.is_dir():
        raise ConfigError(f"--slot-dir {args.slot_dir}: not a directory")
    try:
        size = args.model.stat().st_size
    except OSError as exc:
        raise ConfigError(f"--model {args.model}: {exc.strerror or exc}") from exc
    print(f"kv-relay: hashing {args.model} ({size / 1e9:.2f} GB) ...", file=sys.stderr, flush=True)
    rate = os.environ.get(RATE_ENV)
    return RelaySettings(
        slot_dir=args.slot_dir.resolve(),
        model_name=args.model.name,
        model_bytes=size,
        model_sha256=file_sha256(args.model),
        access=AccessPolicy(api_keys=(_key(args),), allowed_hosts=hosts),
        server_url=args.server.rstrip("/") if args.server else None,
        max_bytes=args.max_bytes,
        prefill_timeout_s=args.prefill_timeout,
        rate_bytes_per_s=float(rate) if rate else None,
    )


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    sweep_partials(settings.slot_dir)
    app = build_relay_app(settings, ROUTES)
    app.cleanup_ctx.append(client_ctx)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, args.host, args.port).start()
            print(
                f"kv-relay: model sha256 {settings.model_sha256}; slot files in {settings.slot_dir}; "
                f"llama-server {settings.server_url or 'none'}",
                file=sys.stderr,
                flush=True,
            )
            print(f"KV_RELAY_URL=http://{args.host}:{args.port}", flush=True)
            await stop.wait()
        finally:
            await runner.cleanup()

    asyncio.run(main())
    return 0
