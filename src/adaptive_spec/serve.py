"""`adaptive-spec serve`: launch or attach profiles, check they serve one model, run the proxy until stopped."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Coroutine
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import platformdirs
from aiohttp import web

from adaptive_spec.access_options import describe_access
from adaptive_spec.core.access import AccessPolicy
from adaptive_spec.core.context import ContextTracker
from adaptive_spec.core.ngram import NgramParams
from adaptive_spec.core.profiles import AttachedProfile, ProfileInfo, ProfileSpec, ServerSettings, model_mismatch
from adaptive_spec.errors import ConfigError, LaunchError, ProfileMismatchError
from adaptive_spec.launcher import Launcher
from adaptive_spec.policy_files import PolicyStore, config_dir
from adaptive_spec.proxy.app import ProxySettings, build_app
from adaptive_spec.proxy.probe import probe, probe_spec_types
from adaptive_spec.proxy.routing import Router
from adaptive_spec.proxy.stats import SessionService
from adaptive_spec.proxy.tokenizers import (
    CachingTokenizer,
    EndpointTokenizer,
    Tokenizer,
    llama_vocab_tokenizer,
    tiktoken_o200k,
)
from adaptive_spec.proxy.trace import TraceWriter
from adaptive_spec.proxy.upstreams import Upstream, UpstreamTable


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class LaunchPlan:
    binary: str
    specs: list[ProfileSpec]
    settings: ServerSettings


@dataclass(frozen=True)
class SessionPlan:
    tokenizer: str = "auto"  # auto | gguf | endpoint | tiktoken | off
    ngram: NgramParams = field(default_factory=NgramParams)
    key_projects: dict[str, str] = field(default_factory=dict)
    max_sessions: int = 64
    max_tokens: int = 131_072
    idle_expiry_s: float = 3600.0


@dataclass(frozen=True)
class ServePlan:
    host: str
    port: int
    proxy: ProxySettings
    default_profile: str | None
    launch: LaunchPlan | None = None
    attach: list[AttachedProfile] = field(default_factory=list)
    sessions: SessionPlan = field(default_factory=SessionPlan)
    trace_path: Path | None = None
    trace_content: bool = False
    trace_max_bytes: int = 64 * 1024 * 1024
    policy_file: Path | None = None  # None: the shipped policies/default.toml
    workspace_policies: bool = True  # read .adaptive-spec.toml in the workspace an agent reveals
    slot_dir: Path | None = None  # attached profiles' shared --slot-save-path (launched ones get their own)
    access: AccessPolicy = field(default_factory=AccessPolicy)


async def _tokenizer(plan: ServePlan, session: aiohttp.ClientSession, default_url: str) -> Tokenizer | None:
    """The token source for session statistics: the GGUF's own, the profile's /tokenize, or tiktoken."""
    choice = plan.sessions.tokenizer
    if choice == "off":
        return None
    model_path = plan.launch.settings.model.path if plan.launch is not None else None
    if choice in ("auto", "gguf") and model_path:
        found = await asyncio.to_thread(llama_vocab_tokenizer, model_path)
        if found is not None:
            return CachingTokenizer(found)
        if choice == "gguf":
            raise ConfigError("--tokenizer gguf needs llama-cpp-python: pip install 'adaptive-spec[gguf-tokenizer]'")
    if choice in ("auto", "endpoint"):
        endpoint = EndpointTokenizer(session, default_url)
        try:
            await endpoint.encode(["probe"])
            return CachingTokenizer(endpoint)
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError) as exc:
            if choice == "endpoint":
                raise LaunchError(f"--tokenizer endpoint: {default_url}/tokenize failed: {exc}") from exc
            say(f"{default_url}/tokenize failed ({exc}); counting tokens with tiktoken o200k_base instead")
    return CachingTokenizer(await asyncio.to_thread(tiktoken_o200k))


def state_dir() -> Path:
    override = os.environ.get("ADAPTIVE_SPEC_STATE_DIR")
    return Path(override) if override else Path(platformdirs.user_state_dir("adaptive-spec"))


def describe(info: ProfileInfo) -> str:
    spec = ",".join(info.spec_types) if info.spec_types else "unknown until its first request"
    return (
        f"  {info.name:<10} {info.base_url}  model={info.model_identity}  n_ctx={info.n_ctx} "
        f"slots={info.total_slots} speculative={info.speculative} spec-types={spec}"
    )


async def _run(plan: ServePlan, stop: asyncio.Event) -> None:
    launcher: Launcher | None = None
    run_dir: Path | None = None
    runner: web.AppRunner | None = None
    client = aiohttp.ClientSession()
    try:
        names = [a.name for a in plan.attach] + ([s.name for s in plan.launch.specs] if plan.launch else [])
        # A bad policy file stops us before any server starts.
        policies = PolicyStore(plan.policy_file, names, config_dir(), read_workspace_files=plan.workspace_policies,
                               log=say)  # fmt: skip
        upstreams = [Upstream(a.name, a.base_url, a.upstream_model) for a in plan.attach]
        if plan.launch is not None:
            state_dir().mkdir(parents=True, exist_ok=True)
            run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=state_dir()))
            launcher = Launcher(plan.launch.binary, plan.launch.specs, plan.launch.settings, run_dir=run_dir, say=say)
            if not await _until_stopped(launcher.start(), stop):
                return
            upstreams = [Upstream(name, url) for name, url in launcher.endpoints.items()]
        table = UpstreamTable(upstreams, plan.default_profile)
        if launcher is not None:
            launcher.set_health_hooks(table.mark_up, table.mark_down)
        infos = [await probe(client, u) for u in upstreams]
        if plan.launch is not None:  # before its first request /slots does not say; the launcher knows
            known = {spec.name: spec.spec_types for spec in plan.launch.specs}
            infos = [replace(i, spec_types=i.spec_types or known.get(i.name)) for i in infos]
        else:  # the router must know which attached profiles draft from n-grams: ask each one that has not said
            infos = [await probe_spec_types(client, u, i) for u, i in zip(upstreams, infos, strict=True)]
        say("profiles:")
        for info in infos:
            say(describe(info))
        mismatch = model_mismatch(infos)
        if mismatch:
            raise ProfileMismatchError(mismatch)
        default = table.get(table.default)
        assert default is not None
        tokenizer = await _tokenizer(plan, client, default.base_url)
        sp = plan.sessions
        tracker = ContextTracker(sp.ngram, max_sessions=sp.max_sessions, max_tokens=sp.max_tokens,
                                 idle_expiry_s=sp.idle_expiry_s)  # fmt: skip
        sessions = SessionService(tracker, tokenizer, sp.key_projects)
        say(f"sessions: tokens from {tokenizer.name if tokenizer else 'nowhere (statistics off)'}")
        trace = None
        if plan.trace_path is not None:
            trace = TraceWriter(plan.trace_path, max_bytes=plan.trace_max_bytes, content=plan.trace_content)
            trace.write({"kind": "profiles", "at_unix": time.time(), "profiles": [asdict(i) for i in infos]})
            say(f"trace: {plan.trace_path}" + (" (with prompts and replies)" if plan.trace_content else ""))
        slot_dir = run_dir / "slots" if run_dir is not None else plan.slot_dir
        router = Router(table, policies, {i.name: i.total_slots for i in infos}, {i.name: i.spec_types for i in infos},
                        slot_dir=slot_dir)  # fmt: skip
        described = policies.describe("default", None)
        say(
            f"routing: policy from {', '.join(described['sources']) or 'built-in defaults'}; KV handoff "
            + ("on (slot files in " + str(slot_dir) + ")" if slot_dir else "off (no shared slot directory)")
        )
        app = build_app(table, plan.proxy, sessions, trace=trace, profiles=infos, router=router,
                        restart=launcher.restart if launcher is not None else None, access=plan.access)  # fmt: skip
        say(describe_access(plan.access))
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, plan.host, plan.port).start()
        except OSError as exc:
            raise LaunchError(f"cannot listen on {plan.host}:{plan.port}: {exc.strerror or exc}") from exc
        base = f"http://{plan.host}:{plan.port}/v1"
        say(f"adaptive-spec is serving; default profile {table.default!r}. Point your editor at:")
        print(f"OPENAI_BASE_URL={base}", flush=True)
        await stop.wait()
        say("stopping")
    finally:
        if runner is not None:
            await runner.cleanup()
        await client.close()
        if launcher is not None:
            await launcher.stop()
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)


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


def run(plan: ServePlan) -> None:
    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await _run(plan, stop)

    asyncio.run(main())
