"""The speed model kept across runs, under the identity of what it measured (each launched server's build, model,
arguments and machine), and each launched server's speeds measured once at start where nothing is kept: a short fixed
prompt, the proxy's own request, recorded as such, so the first client's estimate is not the policy's prior.

The measuring runs in the background, but is in the server's queue before the proxy listens: a client's request that
comes meanwhile waits behind it (a few seconds) instead of going first and having its slot's KV overwritten, and is
routed once it is over (`measured`), on the measured speeds. A warm start of the head store follows it (`MEASURING`:
it counts the measurement's tokens as the proxy's, not a session's).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import platform
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from adaptive_spec.llama.binary.cpu_faults import build_identity
from adaptive_spec.llama.speculation import merge_fields
from adaptive_spec.llama.upstreams import Upstream
from adaptive_spec.requests.accounting import counts_of
from adaptive_spec.requests.apis import Api
from adaptive_spec.requests.app_keys import BUS, CLIENT, HISTORY, LIFECYCLE, MEASURING, ROUTER, UPSTREAMS
from adaptive_spec.streams.timings import find_timings
from adaptive_spec.telemetry.events import RequestFailed, RequestFinished
from adaptive_spec.telemetry.records import Timings, own_record

log = logging.getLogger(__name__)

OWN = "speed measurement"  # what a record of the proxy's own request says it was for
PREDICT_TOKENS = 32  # decode measured over as many tokens as the speed model learns from
_TIMEOUT = aiohttp.ClientTimeout(total=900)  # a large model on a slow CPU: minutes, not a hang
_QUEUED_WAIT_S = 10.0
ROUTE_WAIT_S = 60.0  # the longest a request waits for the measurements before it is routed on the priors
# Code-like lines, the kind of prompt agents send: ~400 tokens on Qwen's vocabulary, a few seconds on a 0.5B on 1 core.
PROMPT = "\n".join(
    f"def step_{i}(values: list[int]) -> int:\n    return sum(v * {i} for v in values if v % {i + 2})"
    for i in range(16)
)
# Launch arguments that name where this run lives, not how the server computes: left out of the identity.
_RUN_ARGUMENTS = frozenset({"--host", "--port", "--slot-save-path"})


@dataclass(frozen=True, slots=True)
class KeptSpeeds:
    """Where this run's speed model is kept (a file named by its identity) and which launched servers it measures
    when the file holds nothing (their base URLs)."""

    path: Path
    measure: tuple[str, ...]


def identity(commands: Mapping[str, Sequence[str]], machine: str) -> str:
    """A digest of what makes the speeds true: each launched server's build (the binary's file), its model file and
    arguments (less the run's ports and folders), and the machine."""
    servers = sorted(_server_identity(argv) for argv in commands.values())
    text = json.dumps({"servers": servers, "machine": machine}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _server_identity(argv: Sequence[str]) -> list[str]:
    out, skip = [build_identity(argv[0])], False
    for i, arg in enumerate(argv[1:], start=1):
        if skip:
            skip = False
            continue
        if arg in _RUN_ARGUMENTS:
            skip = True
            continue
        out.append(arg)
        if argv[i - 1] in ("-m", "--model", "-md", "--model-draft"):
            out.append(build_identity(arg))  # the model file itself: replaced at the same path is another model
    return out


def machine_identity() -> str:
    """This machine as its speeds depend on it: its name, CPU model and count (a VM moved to other hardware is
    another machine)."""
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                cpu = line.partition(":")[2].strip()
                break
    return f"{platform.node()}|{platform.machine()}|{cpu or platform.processor()}|{os.cpu_count()}"


def read(path: Path) -> dict[str, Any] | None:
    """The kept speed model's snapshot, or None when there is none (or it cannot be read: measured again)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("speeds: %s unreadable (%s): measured again", path, exc)
        return None
    speeds = data.get("speeds") if isinstance(data, dict) else None
    return speeds if isinstance(speeds, dict) else None


def write(path: Path, snapshot: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"saved_at_unix": time.time(), "speeds": snapshot}, indent=1))
    os.replace(tmp, path)


def keep_speeds(app: web.Application, kept: KeptSpeeds, say: Callable[[str], None]) -> None:
    """At start: the kept speed model loaded, else each launched server measured in the background (then kept); at
    shutdown: what was learned kept."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        speeds = app[ROUTER].speeds
        snapshot = read(kept.path)
        app[MEASURING] = {}
        if snapshot is not None and speeds.restore(snapshot):
            say(f"speeds: measured before on this build, model, arguments and machine ({kept.path})")
        else:
            tasks = {url: asyncio.create_task(_measure(app, url, say)) for url in kept.measure}
            app[MEASURING] = tasks
            await asyncio.gather(*(_queued(app[CLIENT], url, task) for url, task in tasks.items()))
        keeping = asyncio.create_task(_keep_after(list(app[MEASURING].values()), app, kept.path))
        yield
        work = [*app[MEASURING].values(), keeping]
        for task in work:
            task.cancel()
        await asyncio.gather(*work, return_exceptions=True)
        if speeds.basis() == "measured":
            _write_logged(kept.path, speeds.snapshot())

    app.cleanup_ctx.append(ctx)


async def _queued(client: aiohttp.ClientSession, base_url: str, task: asyncio.Task[int]) -> None:
    """Until the server is processing the measurement (or it is over), `_QUEUED_WAIT_S` at most."""
    deadline = time.monotonic() + _QUEUED_WAIT_S
    while not task.done() and time.monotonic() < deadline:
        try:
            async with client.get(f"{base_url}/slots", timeout=aiohttp.ClientTimeout(total=1)) as resp:
                slots = await resp.json(content_type=None) if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            slots = None
        if not isinstance(slots, list):
            return  # no /slots to ask: nothing to wait for
        if any(isinstance(s, dict) and s.get("is_processing") for s in slots):
            return
        await asyncio.sleep(0.02)


async def _keep_after(tasks: Sequence[asyncio.Task[int]], app: web.Application, path: Path) -> None:
    """The measurements, once made, kept at once (a run killed later does not measure them again)."""
    if not tasks:
        return
    await asyncio.gather(*tasks, return_exceptions=True)
    if app[ROUTER].speeds.basis() == "measured":
        await asyncio.to_thread(_write_logged, path, app[ROUTER].speeds.snapshot())


def _write_logged(path: Path, snapshot: Mapping[str, Any]) -> None:
    try:
        write(path, snapshot)
    except OSError as exc:
        log.warning("speeds: could not keep them in %s: %s", path, exc)


async def measured(app: web.Application) -> None:
    """Wait for the speed measurements at start still under way: a request that comes meanwhile would queue behind
    them on the server anyway, and routed after them it is estimated on measured speeds, not on the priors."""
    pending = [task for task in (app.get(MEASURING) or {}).values() if not task.done()]
    if pending:  # bounded: a server that hangs at start must not hold every request (its reason then says "prior")
        await asyncio.wait([asyncio.shield(task) for task in pending], timeout=ROUTE_WAIT_S)


def _through(app: web.Application, base_url: str) -> Upstream | None:
    """The profile a server is measured through: one that does not speculate when it has one (its decode is then the
    plain speed every estimate starts from), else its first."""
    on = [u for u in app[UPSTREAMS].all() if u.base_url == base_url and u.upstream_model is None]
    speculates = app[ROUTER].speeds.speculates
    return next((u for u in on if not speculates(u.name)), on[0] if on else None)


async def _measure(app: web.Application, base_url: str, say: Callable[[str], None]) -> int:
    """One fixed prompt on that server; its timings replace the priors. The prompt tokens it prefilled (0 when it
    failed: the priors stay, and the reasons say so)."""
    upstream = _through(app, base_url)
    if upstream is None:
        return 0
    started, started_unix = time.perf_counter(), time.time()
    accounting = app[LIFECYCLE].accounting  # the proxy's own request counts in llama-server's counters too
    await accounting.before_forward(app[CLIENT], upstream.base_url)
    accounting.forwarded(upstream.base_url)
    timings, error = await _send(app[CLIENT], upstream)
    accounting.ended(app[CLIENT], upstream.base_url, "", counts_of(timings, True))
    speeds = app[ROUTER].speeds
    plain = not speeds.speculates(upstream.name)
    ok = timings is not None and speeds.calibrate(timings, plain)
    _record(app, upstream, timings, error, started, started_unix)
    if not ok or timings is None:
        say(f"speeds: not measured on {upstream.label} ({error or 'too short to tell'}): the policy's priors stand")
        return 0
    rate = speeds.prefill_rate()
    decode = f", decode {1 / speeds.plain_s_per_token(0):.1f} tok/s" if plain else ""
    say(f"speeds: measured on {upstream.label}: prefill {1 / rate.a_s:.0f} tok/s at the start{decode}")
    return timings.prompt_n


async def _send(client: aiohttp.ClientSession, upstream: Upstream) -> tuple[Timings | None, str | None]:
    body: dict[str, Any] = {
        "prompt": PROMPT,
        "n_predict": PREDICT_TOKENS,
        "ignore_eos": True,  # every token decoded, whatever the model makes of the prompt
        "cache_prompt": False,
        "temperature": 0,
        "seed": 1,
    }
    fields, _ = merge_fields(body, upstream.speculation)
    body |= fields
    try:
        async with client.post(f"{upstream.base_url}/completion", json=body, timeout=_TIMEOUT) as resp:
            answer = await resp.json(content_type=None)
            if resp.status != 200:
                return None, f"HTTP {resp.status}"
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return None, str(exc) or type(exc).__name__
    return find_timings(answer), None


def _record(
    app: web.Application,
    upstream: Upstream,
    timings: Timings | None,
    error: str | None,
    started: float,
    started_unix: float,
) -> None:
    """The measurement in the history and on the feed, as the proxy's own request."""
    record = own_record(
        uuid.uuid4().hex[:16],
        own=OWN,
        path="/completion",
        api=Api.COMPLETION,
        profile=upstream.name,
        replica=upstream.replica,
        timings=timings,
        error=error,
        started_at_unix=started_unix,
        total_ms=(time.perf_counter() - started) * 1000.0,
    )
    finished = record.outcome == "finished"
    app[HISTORY].add(record)
    as_json = record.to_json()
    app[BUS].publish(RequestFinished(record=as_json) if finished else RequestFailed(record=as_json))
