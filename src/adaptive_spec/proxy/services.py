"""The services `serve` builds the proxy's app around, each from its settings: the session statistics, the trace, the
state shared with other proxies, the KV movers and heads, and the launched servers' kept speeds.

Each says what it chose through the `say` it is given (the start-up lines)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import aiohttp

from adaptive_spec.common.dirs import state_dir
from adaptive_spec.errors import ConfigError
from adaptive_spec.kv.heads.options import launched_heads
from adaptive_spec.kv.movers import SharedDirMover, SlotMover, start_relay_mover
from adaptive_spec.kv.remote_prefill.shell import start_remote_prefill
from adaptive_spec.llama.launch import Launcher
from adaptive_spec.llama.profiles import ProfileInfo
from adaptive_spec.llama.upstreams import UpstreamTable
from adaptive_spec.policy.model import SharedStatePolicy
from adaptive_spec.proxy.app import KvSetup
from adaptive_spec.proxy.settings import ServeSettings
from adaptive_spec.requests.measured_speeds import KeptSpeeds, machine_identity
from adaptive_spec.requests.measured_speeds import identity as speeds_identity
from adaptive_spec.sessions.service import SessionService
from adaptive_spec.sessions.statistics import ContextTracker
from adaptive_spec.sessions.token_source import choose_tokenizer
from adaptive_spec.sessions.tokenizers import CachingTokenizer
from adaptive_spec.shared_state.options import SharedStateSettings
from adaptive_spec.shared_state.redis_store import RedisStore
from adaptive_spec.shared_state.shell import SharedState
from adaptive_spec.telemetry.bus import EventBus
from adaptive_spec.telemetry.trace import TraceWriter


def shared_state(settings: ServeSettings, policy: SharedStatePolicy, say: Callable[[str], None]) -> SharedState | None:
    """The state shared with other proxies, where `--shared-state` or the proxy's policy (`[shared_state]`, read
    once, here) names it (reached on the first request: a store down at start is an outage like any other)."""
    sp = settings.shared_state or (
        SharedStateSettings(policy.url, policy.lease_s, policy.ttl_s) if policy.url else None
    )
    if sp is None:
        return None
    shared = SharedState(RedisStore(sp.url), sp.lease_s, sp.ttl_s)
    where = "" if settings.shared_state is not None else ", from the policy's [shared_state]"
    say(
        f"shared state: {shared.store.label} (this proxy: {shared.proxy_id}; bookings lapse after {sp.lease_s:g} s"
        f"{where})"
    )
    return shared


def kept_speeds(launcher: Launcher | None) -> KeptSpeeds | None:
    """Launched servers' speeds: kept in the state folder under what they depend on, measured at start when none
    are (attached servers' are learned from their requests alone: the proxy knows nothing of how they were run)."""
    if launcher is None:
        return None
    commands = launcher.commands
    path = state_dir() / "speeds" / f"{speeds_identity(commands, machine_identity())}.json"
    return KeptSpeeds(path, tuple(commands))


async def session_service(
    settings: ServeSettings,
    client: aiohttp.ClientSession,
    table: UpstreamTable,
    infos: list[ProfileInfo],
    bus: EventBus,
    say: Callable[[str], None],
    proxy_id: str | None = None,
) -> SessionService:
    """`proxy_id`: this proxy's name among those sharing state: the tag of the session ids it makes up."""
    default = table.get(table.default)
    assert default is not None
    attached = next((i.model_path for i in infos if i.name == table.default and i.replica == 0), "")
    model_path = settings.launch.settings.model.path if settings.launch is not None else None
    tokenizer = await choose_tokenizer(
        settings.sessions.tokenizer, model_path, client, default.base_url, attached, verbose=settings.verbose, say=say
    )
    if isinstance(tokenizer, CachingTokenizer):  # its first encode builds the encoder (~0.7 s): not on a request
        await tokenizer.count(["warm up"])
    sp = settings.sessions
    tracker = ContextTracker(
        sp.ngram, max_sessions=sp.max_sessions, max_tokens=sp.max_tokens, idle_expiry_s=sp.idle_expiry_s
    )
    say(f"sessions: tokens from {tokenizer.name if tokenizer else 'nowhere (statistics off)'}")
    return SessionService(
        tracker,
        tokenizer,
        sp.key_projects,
        publish=bus.publish,
        worker_process=True,
        max_fingerprints=sp.echo_fingerprints,
        # Generated session ids unique across runs (s000001-3fa2), and across the proxies that share state.
        run=proxy_id or secrets.token_hex(2),
    )


def trace_writer(settings: ServeSettings, infos: list[ProfileInfo], say: Callable[[str], None]) -> TraceWriter | None:
    if settings.trace_path is None:
        return None
    try:
        trace = TraceWriter(settings.trace_path, max_bytes=settings.trace_max_bytes, content=settings.trace_content)
    except OSError as exc:
        raise ConfigError(f"--trace {settings.trace_path}: {exc.strerror or exc}") from exc
    trace.write({"kind": "profiles", "at_unix": time.time(), "profiles": [asdict(i) for i in infos]})
    say(f"trace: {settings.trace_path}" + (" (with prompts and replies)" if settings.trace_content else ""))
    return trace


async def kv_setup(
    settings: ServeSettings,
    client: aiohttp.ClientSession,
    table: UpstreamTable,
    infos: list[ProfileInfo],
    slot_dir: Path | None,
    say: Callable[[str], None],
) -> KvSetup:
    """The KV movers: the shared slot directory, the relays between hosts (checked and probed), remote prefill."""
    mover: SlotMover | None = SharedDirMover(slot_dir) if slot_dir is not None else None
    link = None
    if settings.relays is not None:
        mover, link = await start_relay_mover(settings.relays, client, table, mover, say)
    remote = None
    if settings.remote_prefill is not None:
        model_path = settings.launch.settings.model.path if settings.launch is not None else infos[0].model_path
        remote = await start_remote_prefill(settings.remote_prefill, client, model_path, slot_dir, say)
    heads = None
    if settings.heads is not None and slot_dir is not None:
        launch = settings.launch
        binary, extra = (launch.binary, launch.settings.extra_args) if launch is not None else (None, ())
        heads = launched_heads(settings.heads, state_dir() / "heads", binary, extra, settings.sessions.key_projects)
        say(f"heads: {heads.directory} (at most {heads.max_bytes / 1024**3:g} GiB, least recently used go first)")
        say("heads: the most recent are restored into a fresh server's idle slots, at start and after a restart")
    elif settings.heads is not None:
        say("heads: off (no slot directory to restore from)")
    return KvSetup(slot_dir, mover, remote, link, heads, say=say)
