"""The `adaptive-spec` command line; `main` is the one place that turns exceptions into exit codes."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from adaptive_spec import __version__
from adaptive_spec.access.options import access_policy, add_access_arguments, api_key
from adaptive_spec.cli import build_server as build_command
from adaptive_spec.cli import relay as relay_command
from adaptive_spec.cli import text
from adaptive_spec.cli import tui as tui_command
from adaptive_spec.errors import AdaptiveSpecError, ConfigError
from adaptive_spec.kv.prefill_options import add_pp_arguments, pp_plan
from adaptive_spec.kv.relay_options import add_relay_arguments, relay_plan
from adaptive_spec.server.app import ProxySettings
from adaptive_spec.server.serve import LaunchPlan, ServePlan, SessionPlan, run, say
from adaptive_spec.servers.models import DEFAULT_MODEL, EMBEDDED, embedded_chat_template, ensure_embedded, resolve_model
from adaptive_spec.servers.profiles import (
    DRAFT_TYPES,
    AttachedProfile,
    ModelSource,
    NgramModParams,
    ServerSettings,
    check_profile_name,
    default_profiles,
)
from adaptive_spec.sessions.drafter import NgramParams

RAW = argparse.RawDescriptionHelpFormatter  # keep the examples' columns


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adaptive-spec", description=text.MAIN, epilog=text.MAIN_EXAMPLES, formatter_class=RAW
    )
    parser.add_argument("--version", action="version", version=f"adaptive-spec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="run the proxy in front of llama-server profiles",
        description=text.SERVE,
        epilog=text.SERVE_EXAMPLES,
        formatter_class=RAW,
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to serve on (default: %(default)s; 0.0.0.0: every interface)"
    )
    serve.add_argument("--port", type=int, default=8088, help="port to serve on (default: %(default)s)")
    serve.add_argument(
        "--verbose", action="store_true", help="also show native libraries' logs (llama.cpp's, loading the tokenizer)"
    )
    serve.add_argument("--tui", action="store_true", help="serve, and watch it in the terminal UI (adaptive-spec tui)")
    attach = serve.add_argument_group("attach to servers you run (no launching)")
    attach.add_argument(
        "--profile",
        action="append",
        default=[],
        metavar="NAME=URL[#MODEL][;types=T,..][;n_max=N]",
        help="a llama-server profile; #MODEL picks a router-mode preset (repeatable; a name given again adds a "
        "replica: a pool of servers for that profile). On a llama-server that takes speculation per request "
        "(adaptive-spec build-server), ;types= names the --spec-type subset its requests may draft with (none: no "
        "drafting) and ;n_max= caps the draft length; profiles naming one such server share its slots and KV",
    )
    launch = serve.add_argument_group("launch llama-server profiles (the default)")
    launch.add_argument(
        "--model",
        default=f"embedded:{DEFAULT_MODEL}",
        help="GGUF path, hf:REPO[:QUANT], or embedded:NAME (default: %(default)s)",
    )
    launch.add_argument("--draft", help="draft model for --draft-type (path, hf:, or embedded:)")
    launch.add_argument(
        "--draft-type",
        choices=sorted(DRAFT_TYPES),
        help="drafter: oneshot = drafter alone, iterative = drafter + ngram-mod",
    )
    launch.add_argument("--draft-n-max", type=int, default=15)
    launch.add_argument(
        "--llama-server",
        help="llama-server binary (default: $ADAPTIVE_SPEC_LLAMA_SERVER, else the patched build that "
        "adaptive-spec build-server made)",
    )
    launch.add_argument(
        "--server-per-profile",
        action="store_true",
        help="one llama-server per profile even when it takes speculation per request (a switch then moves the "
        "session's KV between servers); default: one server, each profile a per-request setting of it",
    )
    launch.add_argument(
        "--device-memory",
        type=int,
        metavar="MIB",
        help="fit the launch to a device of this many MiB (default: the first NVIDIA GPU that nvidia-smi reports; "
        "none: only the memory is stated)",
    )
    launch.add_argument(
        "--ctx-size",
        type=int,
        default=32768,
        help="each server's context, llama-server's -c (default: %(default)s; --parallel N slots get 1/N each)",
    )
    launch.add_argument(
        "--threads",
        type=int,
        default=max(1, (os.cpu_count() or 2) // 2),
        help="threads per server (default: half the cores, as two profiles can decode at once)",
    )
    launch.add_argument("--parallel", type=int, default=1, help="slots per server")
    launch.add_argument(
        "--start-timeout",
        type=float,
        default=600.0,
        help="seconds a profile may take to load and answer /health before serve gives up (default: %(default)s)",
    )
    launch.add_argument(
        "--ngram-mod",
        default=None,
        metavar="MATCH,MIN,MAX",
        help="ngram-mod n-match,n-min,n-max for the iterative profile",
    )
    launch.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra llama-server argument, passed to every profile (repeatable)",
    )
    add_access_arguments(serve)
    serve.add_argument("--default-profile", help="profile for requests without a pin (default: the first)")
    serve.add_argument("--max-body-mb", type=float, default=32.0)
    serve.add_argument(
        "--read-timeout", type=float, default=600.0, help="seconds of upstream silence before a request fails (504)"
    )
    serve.add_argument(
        "--shutdown-grace",
        type=float,
        default=10.0,
        help="on Ctrl-C or SIGTERM, seconds a request in flight may run on; then it ends with an error (503, or a "
        "final error event in a stream)",
    )
    serve.add_argument("--history", type=int, default=1000, help="request records kept for /adaptive/requests")
    routing = serve.add_argument_group("routing policy")
    routing.add_argument(
        "--policy",
        type=Path,
        metavar="FILE.toml",
        help="policy file instead of the shipped policies/default.toml (reloaded when it changes)",
    )
    routing.add_argument(
        "--no-workspace-policies",
        action="store_true",
        help="do not read .adaptive-spec.toml in the workspace an agent reveals",
    )
    routing.add_argument(
        "--slot-dir",
        type=Path,
        metavar="DIR",
        help="the --slot-save-path every attached profile shares: lets a moving session's KV cache be handed over",
    )
    add_pp_arguments(serve)
    add_relay_arguments(serve)
    trace = serve.add_argument_group("trace")
    trace.add_argument("--trace", metavar="FILE.jsonl", help="write every request record to this JSONL file")
    trace.add_argument("--trace-content", action="store_true", help="also keep prompts and replies in the trace")
    trace.add_argument("--trace-max-mb", type=float, default=64.0, help="rotate the trace at this size (3 kept)")
    trace.add_argument(
        "--feed-content",
        action="store_true",
        help="the live event feed also carries streamed answers' text (for the TUI's live text); off by default",
    )
    sessions = serve.add_argument_group("sessions and repeated-context statistics")
    sessions.add_argument(
        "--tokenizer",
        choices=["auto", "gguf", "endpoint", "tiktoken", "off"],
        default="auto",
        help="token source: the GGUF's own (llama-cpp-python), the profile's /tokenize, tiktoken",
    )
    sessions.add_argument(
        "--project-key",
        action="append",
        default=[],
        metavar="API_KEY=PROJECT",
        help="requests with this API key belong to PROJECT (repeatable)",
    )
    sessions.add_argument("--max-sessions", type=int, default=64)
    sessions.add_argument("--session-tokens", type=int, default=131_072, help="tokens indexed per session")
    sessions.add_argument(
        "--session-idle", type=float, default=3600.0, help="seconds before an idle session is dropped"
    )
    bench = sub.add_parser(
        "bench",
        help="run workloads on every profile of a running proxy; table, CSV, JSON, chart",
        description=text.BENCH,
        epilog=text.BENCH_EXAMPLES,
        formatter_class=RAW,
    )
    bench.add_argument(
        "--url", default="http://127.0.0.1:8088", help="the running adaptive-spec (default: %(default)s)"
    )
    bench.add_argument(
        "--workload",
        action="append",
        default=[],
        metavar="iterative|oneshot|mixed|FILE",
        help="workload(s) to run (repeatable; default: iterative, oneshot and mixed)",
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
    report = sub.add_parser(
        "report",
        help="the per-profile table (tok/s, acceptance, TTST) from a trace",
        description=text.REPORT,
        epilog=text.REPORT_EXAMPLES,
        formatter_class=RAW,
    )
    report.add_argument("trace", nargs="+", type=Path, help="trace JSONL file(s) written by serve --trace")
    report.add_argument("--out", type=Path, help="folder for report.csv, report.md and report.png")
    report.add_argument(
        "--baseline", help="profile the ratios are taken against (default: the one without speculation)"
    )
    model = sub.add_parser(
        "model",
        help="print the path of an embedded model, assembling it if needed",
        description=text.MODEL,
        epilog=text.MODEL_EXAMPLES,
        formatter_class=RAW,
    )
    model.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(EMBEDDED))
    _policy_parser(sub)
    tui_command.add_parser(sub)
    relay_command.add_parser(sub)
    build_command.add_parser(sub)
    return parser


def _policy_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    policy = sub.add_parser(
        "policy",
        help="check routing policy files, or show the policy a project gets",
        description=text.POLICY,
        epilog=text.POLICY_EXAMPLES,
        formatter_class=RAW,
    )
    actions = policy.add_subparsers(dest="policy_command", required=True)
    check = actions.add_parser(
        "check",
        help="report every problem of policy files (exit 1 if any)",
        description=text.POLICY_CHECK,
        epilog=text.POLICY_CHECK_EXAMPLES,
        formatter_class=RAW,
    )
    check.add_argument(
        "files",
        nargs="*",
        type=Path,
        metavar="FILE",
        help="default: the shipped default, <config dir>/policies/*.toml and ./.adaptive-spec.toml",
    )
    show = actions.add_parser(
        "show",
        help="print the effective policy of a project (TOML, or JSON with --json)",
        description=text.POLICY_SHOW,
        epilog=text.POLICY_SHOW_EXAMPLES,
        formatter_class=RAW,
    )
    show.add_argument("--project", default="default", help="the project (default: %(default)s)")
    show.add_argument("--workspace", help="the workspace folder, whose .adaptive-spec.toml applies last")
    show.add_argument("--policy", type=Path, metavar="FILE", help="base policy file (default: the shipped one)")
    show.add_argument("--json", action="store_true", help="JSON with the sources and problems")
    for action in (check, show):
        action.add_argument(
            "--profiles", help="comma-separated profiles served: route.force and route.profiles must name them"
        )


def _policy(args: argparse.Namespace) -> int:
    """`policy check` and `policy show`; exit 1 when a file has problems."""
    import json

    from adaptive_spec.routing.policy import policy_to_toml
    from adaptive_spec.routing.policy_files import PolicyStore, check_files, config_dir

    known = [p for p in args.profiles.split(",") if p] if args.profiles else None
    if args.policy_command == "check":
        results = check_files(args.files, known)
        for name, problems in results:
            print("\n".join(str(p) for p in problems) if problems else f"ok: {name}")
        return 1 if any(problems for _, problems in results) else 0
    store = PolicyStore(args.policy, known, config_dir(), read_workspace_files=True)
    workspace = str(Path(args.workspace).resolve()) if args.workspace else None
    described = store.describe(args.project, workspace)
    if args.json:
        print(json.dumps(described, indent=2))
    else:
        print(policy_to_toml(store.policy_for(args.project, workspace)), end="")
    for problem in described["problems"]:
        print(f"problem: {problem}", file=sys.stderr)
    return 1 if described["problems"] else 0


def _ngram_params(text: str | None) -> NgramModParams:
    from adaptive_spec.servers.profiles import SMALL_MODEL_NGRAM_MOD

    if text is None:
        return SMALL_MODEL_NGRAM_MOD
    try:
        n_match, n_min, n_max = (int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(f"--ngram-mod {text!r}: expected three integers MATCH,MIN,MAX") from None
    if not (n_match > 0 and 0 < n_min <= n_max):
        raise ConfigError(f"--ngram-mod {text!r}: need MATCH > 0 and 0 < MIN <= MAX")
    return NgramModParams(n_match, n_min, n_max)


def _session_plan(args: argparse.Namespace, ngram: NgramModParams) -> SessionPlan:
    key_projects = {}
    for item in args.project_key:
        key, sep, project = item.partition("=")
        if not sep or not key or not project:
            raise ConfigError(f"--project-key {item!r}: expected API_KEY=PROJECT")
        key_projects[key] = project
    return SessionPlan(
        tokenizer=args.tokenizer,
        ngram=NgramParams(ngram.n_match, ngram.n_min, ngram.n_max),
        key_projects=key_projects,
        max_sessions=args.max_sessions,
        max_tokens=args.session_tokens,
        idle_expiry_s=args.session_idle,
    )


def _trace_options(args: argparse.Namespace) -> dict[str, Any]:
    if args.trace_content and not args.trace:
        raise ConfigError("--trace-content needs --trace FILE.jsonl")
    return {
        "trace_path": Path(args.trace) if args.trace else None,
        "trace_content": args.trace_content,
        "trace_max_bytes": int(args.trace_max_mb * 1024 * 1024),
    }


def _routing_options(args: argparse.Namespace) -> dict[str, Any]:
    if args.slot_dir is not None and not args.profile:
        raise ConfigError("--slot-dir is for attached profiles (--profile); launched profiles share one already")
    return {
        "policy_file": args.policy,
        "workspace_policies": not args.no_workspace_policies,
        "slot_dir": args.slot_dir,
        "remote_prefill": pp_plan(args),
        "relays": relay_plan(args),
    }


def attached_profiles(texts: Sequence[str]) -> list[AttachedProfile]:
    """`--profile NAME=URL`, repeatable; a name given again adds a replica to that profile's pool (in order)."""
    attached = [AttachedProfile.parse(t) for t in texts]
    seen: set[tuple[str, str, str | None]] = set()
    for a in attached:
        key = (a.name, a.base_url, a.upstream_model)
        if key in seen:
            raise ConfigError(f"--profile {a.name}={a.base_url} is given twice; each replica is a different server")
        seen.add(key)
    return attached


def _serve_plan(args: argparse.Namespace) -> ServePlan:
    proxy = ProxySettings(
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        read_timeout_s=args.read_timeout,
        history_size=args.history,
        feed_content=args.feed_content,
        shutdown_grace_s=args.shutdown_grace,
    )
    # Before anything is launched or assembled: a refusal to listen without a key comes first.
    access = access_policy(args, [k for k, _, _ in (item.partition("=") for item in args.project_key) if k])
    if args.default_profile:
        check_profile_name(args.default_profile)

    def plan(**profiles: Any) -> ServePlan:  # attached profiles or launched ones: the rest is the same
        return ServePlan(
            args.host,
            args.port,
            proxy,
            args.default_profile,
            sessions=_session_plan(args, _ngram_params(args.ngram_mod)),
            verbose=args.verbose,
            access=access,
            **profiles,
            **_trace_options(args),
            **_routing_options(args),
        )

    if args.profile:
        return plan(attach=attached_profiles(args.profile))
    from adaptive_spec.servers.launcher import find_llama_server

    if args.draft_type and not args.draft and args.draft_type != "mtp":
        raise ConfigError(f"--draft-type {args.draft_type} needs --draft D.gguf")
    binary = find_llama_server(args.llama_server)
    settings = ServerSettings(
        model=ModelSource.parse(resolve_model(args.model, say)),
        draft=ModelSource.parse(resolve_model(args.draft, say)) if args.draft else None,
        draft_n_max=args.draft_n_max,
        ctx_size=args.ctx_size,
        threads=args.threads,
        parallel=args.parallel,
        extra_args=tuple(args.server_arg),
        chat_template_file=embedded_chat_template(args.model),
    )
    specs = list(default_profiles(args.draft_type, _ngram_params(args.ngram_mod)))
    launch_plan = LaunchPlan(
        binary,
        specs,
        settings,
        start_timeout_s=args.start_timeout,
        one_server=not args.server_per_profile,
        device_memory_mib=args.device_memory,
    )
    return plan(launch=launch_plan)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve" and args.tui:
            argv = list(sys.argv[1:] if argv is None else argv)
            return tui_command.serve_with_tui(argv, args.host, args.port, api_key(args))
        if args.command == "tui":
            return tui_command.run_tui(args)
        if args.command == "kv-relay":
            return relay_command.run(args)
        if args.command == "build-server":
            return build_command.run(args)
        if args.command == "serve":
            run(_serve_plan(args))
        elif args.command == "bench" and args.simulate:
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
        elif args.command == "policy":
            return _policy(args)
        return 0
    except AdaptiveSpecError as exc:
        print(f"adaptive-spec: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
