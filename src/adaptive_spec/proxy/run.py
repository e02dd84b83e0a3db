"""`adaptive-spec serve`: launch or attach profiles, check they serve one model, run the proxy until stopped."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from adaptive_spec.access.options import describe_access
from adaptive_spec.common.dirs import state_dir
from adaptive_spec.errors import ConfigError, LaunchError, ProfileMismatchError
from adaptive_spec.llama.binary.which import describe_binary, passes_messages_slot
from adaptive_spec.llama.launch import KILL_AFTER_S, Launcher
from adaptive_spec.llama.memory.footprint import device_report, launch_lines
from adaptive_spec.llama.placement import (
    STOCK,
    Launched,
    design_to_launch,
    first_servers,
    health_hooks,
    own_servers,
    probe_profiles,
    restarter,
    settle,
    startup_lines,
)
from adaptive_spec.llama.profiles import (
    model_mismatch,
    replica_mismatch,
    speculation_problem,
)
from adaptive_spec.llama.upstreams import Upstream, UpstreamTable
from adaptive_spec.policy.files import PolicyStore, config_dir
from adaptive_spec.proxy.app import build_app
from adaptive_spec.proxy.app_stop import stop_app
from adaptive_spec.proxy.connections import WatchedSite, watch_connections
from adaptive_spec.proxy.event_loop import loop_factory, loop_name
from adaptive_spec.proxy.services import kept_speeds, kv_setup, session_service, shared_state, trace_writer
from adaptive_spec.proxy.settings import LaunchSettings, ServeSettings
from adaptive_spec.proxy.sharing import launching
from adaptive_spec.requests.app_keys import LIFECYCLE
from adaptive_spec.sessions.agents.client_limits import start_line
from adaptive_spec.telemetry.bus import EventBus
from adaptive_spec.telemetry.events import Event, ProfileDown, ProfileUp


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# The stop after the grace, each phase bounded so that `serve` exits within the grace + 5 s whatever llama-server is
# computing: the requests ended at the grace write their error (ms), then at once the proxy's own tasks stop (event
# feeds, health poll, statistics worker) beside the children's SIGTERM, SIGKILL after KILL_AFTER_S. The proxy's
# steps are bounded apart (proxy/app_stop.py): 3.5 s at most.
_ENDED_WRITE_S = 0.5  # the ended requests' errors going out
_AIOHTTP_SHUTDOWN_S = 0.5  # aiohttp's own wait per connection (twice at most): the handlers have ended already


def listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for every address `host` names, as aiohttp's TCPSite would bind, but taken before any
    llama-server starts: a port in use fails at once, and nothing can take it while the profiles load."""
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host!r}: {exc.strerror}") from exc
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(addresses):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a restart is not blocked by TIME_WAIT
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(128)  # connections made while the profiles load wait in the backlog
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise LaunchError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc} (is adaptive-spec already running? "
            "choose another --port)"
        ) from exc
    return sockets


def base_url(host: str, sock: socket.socket) -> str:
    """The root URL clients reach the proxy at; the real port, so `--port 0` prints the one it got."""
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{sock.getsockname()[1]}"


def _examples_dir() -> Path | None:
    """The copy-paste agent setups, when running from a source checkout (they are not installed with the package)."""
    found = Path(__file__).resolve().parents[3] / "examples"
    return found if (found / "README.md").is_file() else None


def announce(root: str, default_profile: str, agents_note: str | None = None) -> None:
    """What a person does next: the base URLs for their agent (on stdout, for scripts), how to watch, where the agent
    setups are."""
    say(f"adaptive-spec is serving; default profile {default_profile!r}. Point your editor at:")
    # One write: a script reading the first line gets the OpenAI one; Anthropic clients (Claude Code) take the second,
    # Gemini CLI the third.
    print(f"OPENAI_BASE_URL={root}/v1\nANTHROPIC_BASE_URL={root}\nGOOGLE_GEMINI_BASE_URL={root}", flush=True)
    examples = _examples_dir()
    say(f"watch it:     adaptive-spec tui --url {root}")
    say(
        f"agent setups: {examples or 'examples/ in the adaptive-spec source'} (opencode, Codex CLI, aider, Continue, "
        "openai SDK, Claude Code, Qwen Code, Gemini CLI, pi, Continue CLI, Cline, mini-swe-agent, gptme, "
        "Mistral Vibe); Ctrl-C stops adaptive-spec"
    )
    if agents_note:
        say(agents_note)
    say(start_line())


@dataclass
class _Run:
    """What one `serve` run holds until it stops (one task's own): released by `close()` whatever happened."""

    settings: ServeSettings
    sockets: list[socket.socket]
    client: aiohttp.ClientSession
    launcher: Launcher | None = None
    launched: Launched | None = None
    run_dir: Path | None = None
    runner: web.AppRunner | None = None
    keep_logs: bool = False  # a start-up error names a log file: it must still be there to be read
    phases: list[str] = field(default_factory=list)  # how long each phase of a signalled stop took, for the log

    async def close(self) -> None:
        """The proxy's tasks and the children stopped side by side, each bounded and timed."""
        await asyncio.gather(self._close_proxy(), self._stop_children())
        for sock in self.sockets:
            sock.close()
        if self.run_dir is not None and self.keep_logs:
            shutil.rmtree(self.run_dir / "slots", ignore_errors=True)
            say(f"the profiles' logs are kept in {self.run_dir / 'logs'}")
        elif self.run_dir is not None:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    async def _close_proxy(self) -> None:
        started = time.monotonic()
        cut: list[str] = []
        try:
            if self.runner is not None:
                cut = await stop_app(self.runner, _AIOHTTP_SHUTDOWN_S)
        finally:
            await self.client.close()  # whatever the app's stop did: no session left unclosed
        notes = f" ({'; '.join(cut)})" if cut else ""
        self.phases.append(f"proxy tasks {time.monotonic() - started:.1f} s{notes}")

    async def _stop_children(self) -> None:
        if self.launcher is None:
            return
        started = time.monotonic()
        killed = await self.launcher.stop(KILL_AFTER_S)
        forced = f", {killed} killed after SIGTERM + {KILL_AFTER_S:g} s" if killed else " (SIGTERM)"
        self.phases.append(f"llama-server {time.monotonic() - started:.1f} s{forced}")


async def _run(settings: ServeSettings, stop: asyncio.Event) -> None:
    policies = _policies(settings)  # a bad policy file stops us first: before we listen, before any server starts
    run = _Run(settings, listen(settings.host, settings.port), aiohttp.ClientSession())
    try:
        upstreams = [Upstream(a.name, a.base_url, a.upstream_model, speculation=a.speculation) for a in settings.attach]
        if settings.launch is not None:
            launched = await _launch(run, settings.launch, stop)
            if launched is None:
                return  # stopped while starting
            upstreams = launched
        bus = EventBus()  # every service below publishes on it: handed to each constructor
        table = UpstreamTable(upstreams, settings.default_profile, publish=bus.publish)
        if run.launcher is not None and run.launched is not None:
            run.launcher.set_health_hooks(*health_hooks(run.launched, table))
            bus.listen(_hang_watch(run.launcher))
        app = await _app(run, policies, table, bus)
        say(describe_access(settings.access))
        say(f"event loop: {loop_name()}")
        watch = watch_connections(app, settings.connections, say)
        # The shutdown grace is the app's own (it tells each request it ends); aiohttp then waits for them briefly.
        # The connections' handlers are the watch's (WatchedSite), made with their options there.
        run.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=_AIOHTTP_SHUTDOWN_S)
        await run.runner.setup()
        for sock in run.sockets:
            await WatchedSite(run.runner, sock, watch).start()
        announce(base_url(settings.host, run.sockets[0]), table.default, settings.agents_note)
        await stop.wait()
        stopping = time.monotonic()
        await _end_requests(run, app)
    finally:
        await run.close()
    say(f"stopped in {time.monotonic() - stopping:.1f} s: " + ", ".join(run.phases))


async def _end_requests(run: _Run, app: web.Application) -> None:
    """No new connections; requests in flight run for up to the grace, then end with their error."""
    lifecycle, grace = app[LIFECYCLE], run.settings.proxy.shutdown_grace_s
    running = len(lifecycle.handlers)
    say(f"stopping; {running} requests in flight get up to {grace:g} s" if running else "stopping")
    started = time.monotonic()
    assert run.runner is not None
    for site in list(run.runner.sites):
        await site.stop()
    ended = await lifecycle.drain(grace)
    left = list(lifecycle.handlers.values())
    if left:
        await asyncio.wait(left, timeout=_ENDED_WRITE_S)
    ended_note = f", {ended} ended at the grace" if ended else ""
    run.phases.append(f"requests {time.monotonic() - started:.1f} s ({running} in flight{ended_note})")


def _hang_watch(launcher: Launcher) -> Callable[[Event], None]:
    """The launcher hears of its servers marked down and up, to restart one that stays down (hung)."""

    def on_event(event: Event) -> None:
        if isinstance(event, ProfileDown):
            launcher.server_down(event.base_url, event.reason)
        elif isinstance(event, ProfileUp):
            launcher.server_up(event.base_url)

    return on_event


def _policies(settings: ServeSettings) -> PolicyStore:
    names = list(dict.fromkeys(a.name for a in settings.attach)) + (
        [s.name for s in settings.launch.specs] if settings.launch else []
    )
    if settings.default_profile is not None and settings.default_profile not in names:
        raise ConfigError(f"--default-profile {settings.default_profile!r} is not one of {', '.join(names)}")
    return PolicyStore(
        settings.policy_file, names, config_dir(), read_workspace_files=settings.workspace_policies, log=say
    )


async def _launch(run: _Run, launch: LaunchSettings, stop: asyncio.Event) -> list[Upstream] | None:
    """Start the profiles' llama-servers (one for all, or the stock fallback's one per profile); None: stopped."""
    state_dir().mkdir(parents=True, exist_ok=True)
    run.run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=state_dir()))
    first = first_servers(launch.specs, launch.one_server)
    device = device_report(launch.device_memory_mib)
    for line in launch_lines(first, launch.settings, device, design_to_launch(first, launch.specs)):
        say(line)
    say(f"llama-server: {describe_binary(launch.binary)}")
    run.launcher = launcher = Launcher(
        launch.binary,
        first,
        launch.settings,
        run_dir=run.run_dir,
        say=say,
        health_timeout_s=launch.start_timeout_s,
        repack=launch.repack,
        hung_restart_s=launch.hung_restart_s,
    )
    try:
        if not await _until_stopped(launcher.start(), stop):
            return None
        run.launched = await settle(launcher, launch.specs, run.client, lambda work: _until_stopped(work, stop))
        if run.launched is None:
            return None
        if len(first) == 1 < len(launch.specs) and run.launched.design == STOCK:  # the others' servers were added
            for line in launch_lines(own_servers(launch.specs), launch.settings, device, "a stock llama-server"):
                say(line)
    except LaunchError:
        run.keep_logs = True  # the error names a log file: it must still be there to be read
        raise
    slot = passes_messages_slot(launch.binary)
    return [replace(u, messages_slot=slot) for u in run.launched.upstreams]


async def _app(run: _Run, policies: PolicyStore, table: UpstreamTable, bus: EventBus) -> web.Application:
    """Probe the profiles, check they serve one model, and build the proxy around them."""
    settings, client, launched, launcher = run.settings, run.client, run.launched, run.launcher
    infos, servers, probes = await probe_profiles(
        client, table.all(), settings.launch.specs if settings.launch else None
    )
    for line in startup_lines(infos, servers, launched.design if launched is not None else None):
        say(line)
    mismatch = replica_mismatch(infos) or model_mismatch(infos) or speculation_problem(infos)
    if mismatch:
        raise ProfileMismatchError(mismatch)
    shared = shared_state(settings, policies.policy_for("default", None).shared_state, say)
    proxy_id = shared.proxy_id if shared is not None else None
    sessions = await session_service(settings, client, table, infos, bus, say, proxy_id)
    trace = trace_writer(settings, infos, say)
    slot_dir = run.run_dir / "slots" if run.run_dir is not None else settings.slot_dir
    kv = await kv_setup(settings, client, table, infos, slot_dir, say)
    described = policies.describe("default", None)
    say(
        f"routing: policy from {', '.join(described['sources']) or 'built-in defaults'}; KV handoff "
        + ("on (slot files in " + str(slot_dir) + ")" if slot_dir else "off (no shared slot directory)")
        + ("; between hosts through the kv-relays" if settings.relays is not None else "")
    )
    app = build_app(
        table,
        settings.proxy,
        sessions,
        bus=bus,
        trace=trace,
        profiles=infos,
        policies=policies,
        servers=servers,
        kv=kv,
        restart=restarter(launched, launcher) if launcher is not None and launched is not None else None,
        access=settings.access,
        speeds=kept_speeds(launcher),
        probes=probes,
        shared=shared,
    )
    if launcher is not None:
        launching(app, list(launcher.commands))
    return app


async def _until_stopped(work: Coroutine[Any, Any, None], stop: asyncio.Event) -> bool:
    """Await `work` unless a stop signal comes first (then cancel it). True when the work finished."""
    task = asyncio.ensure_future(work)
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if task in done:
        task.result()
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False


def run(settings: ServeSettings) -> None:
    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await _run(settings, stop)

    with asyncio.Runner(loop_factory=loop_factory(settings.event_loop)) as runner:
        runner.run(main())
