"""`adaptive-spec serve`: its options and the settings they make (the profiles it launches or attaches, and the rest).

Serve's own groups are declared here beside their readers; the access, remote prefill and relay groups beside their
features."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from adaptive_spec.access.options import API_KEY, access_policy, add_access_arguments
from adaptive_spec.cli import text
from adaptive_spec.cli import tui as tui_command
from adaptive_spec.cli.text import add_command
from adaptive_spec.errors import ConfigError
from adaptive_spec.kv.heads.options import add_heads_arguments, heads_config
from adaptive_spec.kv.movers_options import add_relay_arguments, relay_settings
from adaptive_spec.kv.remote_prefill.options import add_pp_arguments, pp_settings
from adaptive_spec.llama.binary.cpu_faults import REPACK_MODES
from adaptive_spec.llama.launch import HUNG_RESTART_S, KILL_AFTER_S
from adaptive_spec.llama.models import DEFAULT_MODEL, agents_advice, embedded_chat_template, resolve_model
from adaptive_spec.llama.profiles import (
    DRAFT_TYPES,
    AttachedProfile,
    ModelSource,
    NgramModParams,
    ServerSettings,
    check_profile_name,
    default_profiles,
)
from adaptive_spec.proxy.app import ProxySettings
from adaptive_spec.proxy.connection_options import add_connection_arguments, connection_limits
from adaptive_spec.proxy.event_loop import EVENT_LOOPS
from adaptive_spec.proxy.run import run as run_server
from adaptive_spec.proxy.run import say
from adaptive_spec.proxy.settings import LaunchSettings, ServeSettings, SessionSettings
from adaptive_spec.sessions.grouping import ECHO_FINGERPRINTS
from adaptive_spec.sessions.ngram_replay import NgramParams
from adaptive_spec.shared_state.options import add_shared_state_arguments, shared_state_settings


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = add_command(
        sub, "serve", "run the proxy in front of llama-server profiles", text.SERVE, text.SERVE_EXAMPLES
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
    _add_launch_arguments(serve)
    add_access_arguments(serve)
    serve.add_argument("--default-profile", help="profile for requests without a pin (default: the first)")
    serve.add_argument("--max-body-mb", type=float, default=32.0)
    serve.add_argument(
        "--read-timeout",
        type=float,
        default=600.0,
        help="seconds of upstream silence before a request fails (504); a request waiting its turn while the server "
        "answers another one is not met with silence, and its count starts when that answer ends",
    )
    serve.add_argument(
        "--prefill-keepalive",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a streamed request the server has not answered after this long gets its 200 headers and then a "
        "keep-alive every SECONDS (a chunk with no choices on chat/completions, Anthropic's ping on /v1/messages, an "
        "SSE comment elsewhere), so an agent's stream idle "
        "timeout does not end a long prefill; 0 turns them off (default: %(default)s)",
    )
    serve.add_argument(
        "--shutdown-grace",
        type=float,
        default=10.0,
        help="on Ctrl-C or SIGTERM, seconds a request in flight may run on; then it ends with an error (503, or a "
        "final error event in a stream), and each launched llama-server gets SIGTERM, then SIGKILL after "
        f"{KILL_AFTER_S:g} s: serve exits within the grace + 5 s (default: %(default)s)",
    )
    serve.add_argument("--history", type=int, default=1000, help="request records kept for /adaptive/requests")
    serve.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default="asyncio",
        help="the event loop the proxy runs on: Python's own, or uvloop's (pip install uvloop; measured: less CPU per "
        "request, no sooner answers) (default: %(default)s)",
    )
    add_connection_arguments(serve)
    _add_routing_arguments(serve)
    add_pp_arguments(serve)
    add_relay_arguments(serve)
    add_heads_arguments(serve)
    _add_trace_arguments(serve)
    _add_session_arguments(serve)
    add_shared_state_arguments(serve)


def run(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """Serves until stopped; with --tui, as a child process watched by the TUI in this one."""
    if args.tui:
        argv = list(sys.argv[1:] if argv is None else argv)
        return tui_command.serve_with_tui(argv, args.host, args.port, API_KEY.read(args))
    run_server(serve_settings(args))
    return 0


def serve_settings(args: argparse.Namespace) -> ServeSettings:
    """The settings `serve` runs: attached profiles, or the profiles it launches, and the rest of its options."""
    proxy = ProxySettings(
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        read_timeout_s=args.read_timeout,
        history_size=args.history,
        feed_content=args.feed_content,
        shutdown_grace_s=args.shutdown_grace,
        prefill_keepalive_s=args.prefill_keepalive,
    )
    # Before anything is launched or assembled: a refusal to listen without a key comes first.
    access = access_policy(args, [k for k, _, _ in (item.partition("=") for item in args.project_key) if k])
    if args.default_profile:
        check_profile_name(args.default_profile)

    def with_profiles(**profiles: Any) -> ServeSettings:  # attached profiles or launched ones: the rest is the same
        return ServeSettings(
            args.host,
            args.port,
            proxy,
            args.default_profile,
            sessions=_session_settings(args, _ngram_params(args.ngram_mod)),
            verbose=args.verbose,
            event_loop=args.event_loop,
            access=access,
            **profiles,
            connections=connection_limits(args),
            shared_state=shared_state_settings(args),
            **_trace_options(args),
            **_routing_options(args),
        )

    if args.profile:
        return with_profiles(attach=attached_profiles(args.profile))
    return with_profiles(launch=_launch_settings(args), agents_note=agents_advice(args.model))


def _add_launch_arguments(serve: argparse.ArgumentParser) -> None:
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
        help="drafter: oneshot = drafter alone, iterative = drafter + ngram-mod; on one patched server also plain "
        "(no speculation) and ngram (n-grams alone), chosen per request",
    )
    launch.add_argument("--draft-n-max", type=int, default=15)
    _add_server_arguments(launch)


def _add_server_arguments(launch: argparse._ArgumentGroup) -> None:
    """The launched llama-servers: binary, how many, their size, and what else they are passed."""
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
        "--restart-hung-after",
        type=float,
        default=HUNG_RESTART_S,
        metavar="SECONDS",
        help="a launched llama-server that stops answering is marked down ~10 s after it hangs (the requests on it end "
        "with an error at once); one still down SECONDS later is killed and restarted (default: %(default)s)",
    )
    launch.add_argument(
        "--ngram-mod",
        default=None,
        metavar="MATCH,MIN,MAX",
        help="ngram-mod n-match,n-min,n-max for the iterative profile",
    )
    launch.add_argument(
        "--cpu-repack",
        choices=REPACK_MODES,
        default="auto",
        help="llama.cpp's CPU weight repacking: auto retries a server that dies of a CPU fault while loading "
        "(SIGILL, SIGSEGV, SIGBUS: some machines advertise AMX and fault on it) with --no-repack and remembers it "
        "for that build and CPU; always never adds --no-repack; never always does (default: %(default)s)",
    )
    launch.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra llama-server argument, passed to every profile (repeatable)",
    )


def _ngram_params(given: str | None) -> NgramModParams:
    from adaptive_spec.llama.profiles import SMALL_MODEL_NGRAM_MOD

    if given is None:
        return SMALL_MODEL_NGRAM_MOD
    try:
        n_match, n_min, n_max = (int(x) for x in given.split(","))
    except ValueError:
        raise ConfigError(f"--ngram-mod {given!r}: expected three integers MATCH,MIN,MAX") from None
    if not (n_match > 0 and 0 < n_min <= n_max):
        raise ConfigError(f"--ngram-mod {given!r}: need MATCH > 0 and 0 < MIN <= MAX")
    return NgramModParams(n_match, n_min, n_max)


def _launch_settings(args: argparse.Namespace) -> LaunchSettings:
    from adaptive_spec.llama.binary.which import find_llama_server

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
    return LaunchSettings(
        binary,
        specs,
        settings,
        start_timeout_s=args.start_timeout,
        one_server=not args.server_per_profile,
        device_memory_mib=args.device_memory,
        repack=args.cpu_repack,
        hung_restart_s=args.restart_hung_after,
    )


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


def _add_routing_arguments(serve: argparse.ArgumentParser) -> None:
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


def _routing_options(args: argparse.Namespace) -> dict[str, Any]:
    if args.slot_dir is not None and not args.profile:
        raise ConfigError("--slot-dir is for attached profiles (--profile); launched profiles share one already")
    return {
        "policy_file": args.policy,
        "workspace_policies": not args.no_workspace_policies,
        "slot_dir": args.slot_dir,
        "remote_prefill": pp_settings(args),
        "relays": relay_settings(args),
        "heads": heads_config(args),
    }


def _add_trace_arguments(serve: argparse.ArgumentParser) -> None:
    trace = serve.add_argument_group("trace")
    trace.add_argument("--trace", metavar="FILE.jsonl", help="write every request record to this JSONL file")
    trace.add_argument("--trace-content", action="store_true", help="also keep prompts and replies in the trace")
    trace.add_argument("--trace-max-mb", type=float, default=64.0, help="rotate the trace at this size (3 kept)")
    trace.add_argument(
        "--feed-content",
        action="store_true",
        help="the live event feed also carries streamed answers' text (for the TUI's live text); off by default",
    )


def _trace_options(args: argparse.Namespace) -> dict[str, Any]:
    if args.trace_content and not args.trace:
        raise ConfigError("--trace-content needs --trace FILE.jsonl")
    return {
        "trace_path": Path(args.trace) if args.trace else None,
        "trace_content": args.trace_content,
        "trace_max_bytes": int(args.trace_max_mb * 1024 * 1024),
    }


def _add_session_arguments(serve: argparse.ArgumentParser) -> None:
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
    sessions.add_argument(
        "--echo-fingerprints",
        type=int,
        default=ECHO_FINGERPRINTS,
        metavar="N",
        help="served replies, and served lines, remembered to group requests that carry no session id (each; "
        "~180 bytes an entry, ~70 MiB when both are full)",
    )


def _session_settings(args: argparse.Namespace, ngram: NgramModParams) -> SessionSettings:
    key_projects = {}
    for item in args.project_key:
        key, sep, project = item.partition("=")
        if not sep or not key or not project:
            raise ConfigError(f"--project-key {item!r}: expected API_KEY=PROJECT")
        key_projects[key] = project
    return SessionSettings(
        tokenizer=args.tokenizer,
        ngram=NgramParams(ngram.n_match, ngram.n_min, ngram.n_max),
        key_projects=key_projects,
        max_sessions=args.max_sessions,
        max_tokens=args.session_tokens,
        idle_expiry_s=args.session_idle,
        echo_fingerprints=args.echo_fingerprints,
    )
