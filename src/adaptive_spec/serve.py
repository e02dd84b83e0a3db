"""`adaptive-spec serve`: launch or attach profiles, check they serve one model, run the proxy until stopped."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import platformdirs
from aiohttp import web

from adaptive_spec.core.profiles import AttachedProfile, ProfileInfo, ProfileSpec, ServerSettings, model_mismatch
from adaptive_spec.errors import LaunchError, ProfileMismatchError
from adaptive_spec.launcher import Launcher
from adaptive_spec.proxy.app import ProxySettings, build_app
from adaptive_spec.proxy.probe import probe
from adaptive_spec.proxy.upstreams import Upstream, UpstreamTable


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class LaunchPlan:
    binary: str
    specs: list[ProfileSpec]
    settings: ServerSettings


@dataclass(frozen=True)
class ServePlan:
    host: str
    port: int
    proxy: ProxySettings
    default_profile: str | None
    launch: LaunchPlan | None = None
    attach: list[AttachedProfile] = field(default_factory=list)


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
    try:
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
        async with aiohttp.ClientSession() as session:
            infos = [await probe(session, u) for u in upstreams]
        say("profiles:")
        for info in infos:
            say(describe(info))
        mismatch = model_mismatch(infos)
        if mismatch:
            raise ProfileMismatchError(mismatch)
        runner = web.AppRunner(build_app(table, plan.proxy), handler_cancellation=True, access_log=None)
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
