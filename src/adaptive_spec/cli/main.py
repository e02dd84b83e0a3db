"""The `adaptive-spec` command line: the top-level parser, the small commands (bench, report, model), and `main`,
the one place that turns exceptions into exit codes; each other command has a module of its own."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from adaptive_spec import __version__
from adaptive_spec.cli import build_server as build_command
from adaptive_spec.cli import policy as policy_command
from adaptive_spec.cli import relay as relay_command
from adaptive_spec.cli import serve as serve_command
from adaptive_spec.cli import text
from adaptive_spec.cli import tui as tui_command
from adaptive_spec.cli.text import add_command
from adaptive_spec.errors import AdaptiveSpecError, ConfigError
from adaptive_spec.llama.models import DEFAULT_MODEL, EMBEDDED, ensure_embedded
from adaptive_spec.proxy.run import say


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adaptive-spec",
        description=text.MAIN,
        epilog=text.MAIN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"adaptive-spec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_command.add_parser(sub)
    bench = add_command(
        sub,
        "bench",
        "run workloads on every profile of a running proxy; table, CSV, JSON, chart",
        text.BENCH,
        text.BENCH_EXAMPLES,
    )
    bench.add_argument(
        "--url", default="http://127.0.0.1:8088", help="the running adaptive-spec (default: %(default)s)"
    )
    bench.add_argument(
        "--workload",
        action="append",
        default=[],
        metavar="iterative|oneshot|mixed|prose|FILE",
        help="workload(s) to run (repeatable; default: iterative, oneshot, mixed and prose)",
    )
    bench.add_argument("--profiles", help="comma-separated profiles to pin (default: all the proxy serves)")
    bench.add_argument("--adaptive", action="store_true", help="also run through the proxy's own route (no pin)")
    bench.add_argument("--max-tokens", type=int, help="cap every request's max_tokens (shorter runs)")
    bench.add_argument(
        "--repeat",
        type=int,
        default=2,
        help="run each target's pass N times, alternating targets and their order: A B C, C B A, ... "
        "(default: %(default)s; the ratios' 95%% intervals rest on requests and rounds)",
    )
    bench.add_argument("--out", type=Path, help="folder for bench.csv, bench.json, bench.md and bench.png")
    bench.add_argument(
        "--simulate",
        choices=["gpu", "cpu", "pp-remote", "pool"],
        help="no proxy: replay the workloads through the routing policy at speeds measured elsewhere "
        "(gpu: the public DFlash benchmark; cpu: this project's 0.5B measurements) and print the comparison; "
        "pp-remote: prefilling a long prompt on a faster remote server vs locally; pool: 4 replicas of a profile "
        "under a day of agent traffic",
    )
    report = add_command(
        sub, "report", "the per-profile table (tok/s, acceptance, TTST) from a trace", text.REPORT, text.REPORT_EXAMPLES
    )
    report.add_argument("trace", nargs="+", type=Path, help="trace JSONL file(s) written by serve --trace")
    report.add_argument("--out", type=Path, help="folder for report.csv, report.md and report.png")
    report.add_argument(
        "--baseline", help="profile the ratios are taken against (default: the one without speculation)"
    )
    model = add_command(
        sub, "model", "print the path of an embedded model, assembling it if needed", text.MODEL, text.MODEL_EXAMPLES
    )
    model.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(EMBEDDED))
    policy_command.add_parser(sub)
    tui_command.add_parser(sub)
    relay_command.add_parser(sub)
    build_command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            return serve_command.run(args, argv)
        if args.command == "tui":
            return tui_command.run_tui(args)
        if args.command == "kv-relay":
            return relay_command.run(args)
        if args.command == "build-server":
            return build_command.run(args)
        if args.command == "policy":
            return policy_command.run(args)
        if args.command == "bench" and args.simulate:
            from adaptive_spec.bench.runner import main_simulate

            print(main_simulate(args.simulate, args.workload, args.out))
        elif args.command == "bench":
            from adaptive_spec.bench.runner import main_bench

            profiles = [p for p in args.profiles.split(",") if p] if args.profiles else None
            if args.repeat < 1:
                raise ConfigError(f"--repeat {args.repeat}: must be 1 or more")
            main_bench(
                args.url,
                args.workload or ["iterative", "oneshot", "mixed"],
                profiles,
                args.adaptive,
                args.out,
                args.max_tokens,
                args.repeat,
            )
        elif args.command == "report":
            from adaptive_spec.bench.trace_report import run_report

            print(run_report(args.trace, args.out, args.baseline))
            if args.out:
                say(f"written: {args.out / 'report.csv'}, {args.out / 'report.md'}, {args.out / 'report.png'}")
        elif args.command == "model":
            print(ensure_embedded(args.name, say))
        return 0
    except AdaptiveSpecError as exc:
        print(f"adaptive-spec: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
