"""Remote prefill's shell (`serve --pp-server`): a long prompt is prefilled on a bigger machine through its kv-relay,
the slot file brought home and restored into the local slot, so the local profile prefills only the tail.

The decision is the router's (`kv/remote_prefill/pricing.choose()`, asked while it plans a route, with the prices
learned here: `RemoteCosts`); this module checks the two models hash the same at start, measures the link, performs
the steps of a remote prefill the router asked for and learns from them. It never raises into the request: any failure
means the local profile prefills the prompt itself (correct, only slower), and the reason line says so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from adaptive_spec.errors import ConfigError, ProfileMismatchError
from adaptive_spec.kv.moves import PrefillAsk, RemotePrefillResult
from adaptive_spec.kv.relay_client import PARTIAL_PREFIX, RelayClient, RelayError
from adaptive_spec.kv.remote_prefill.pricing import RemoteCosts, RemoteMeasurement, RemotePrefillPolicy
from adaptive_spec.kv.slot_files import file_sha256, model_mismatch, slot_file_name
from adaptive_spec.kv.slots import SlotError, restore_slot
from adaptive_spec.llama.upstreams import Upstream

log = logging.getLogger(__name__)
_PROBE_BYTES = 256 << 10


class RemotePrefill:
    """The proxy's remote prefill: one per proxy, set on the app by `serve` (`REMOTE_PREFILL`)."""

    def __init__(
        self,
        relay: RelayClient,
        costs: RemoteCosts,
        slot_dir: Path,
        max_bytes: int = 64 << 30,
        min_deadline_s: float = 30.0,
    ) -> None:
        self.relay, self.costs, self.slot_dir, self.max_bytes = relay, costs, slot_dir, max_bytes
        self.min_deadline_s = min_deadline_s
        self.counts = {"ok": 0, "failed": 0}
        self._seq = 0

    def to_json(self) -> dict[str, Any]:
        return {"relay": self.relay.base_url, "counts": dict(self.counts), "estimates": self.costs.describe()}

    async def connect(self, client: aiohttp.ClientSession) -> str:
        """At start: the relay's model must be ours (else refuse, naming both hashes); then a probe of the link."""
        try:
            model, round_trip_s = await self.relay.model(client)
            bandwidth = await self.relay.probe(client, _PROBE_BYTES)
        except (aiohttp.ClientError, TimeoutError, RelayError, ValueError) as exc:
            raise ProfileMismatchError(f"--pp-server {self.relay.base_url}: {exc or type(exc).__name__}") from exc
        where = f"--pp-server {self.relay.base_url}"
        problem = model_mismatch(str(model.get("sha256")), self.relay.model_sha256, where)
        if problem:
            raise ProfileMismatchError(problem)
        if not model.get("server"):
            raise ProfileMismatchError(f"--pp-server {self.relay.base_url}: the relay has no llama-server (--server)")
        self.costs.observe_link(round_trip_s, bandwidth)
        return (
            f"remote prefill: {self.relay.base_url} runs the same model ({model.get('model')}, sha256 "
            f"{self.relay.model_sha256[:12]}…); link {round_trip_s * 1000:.0f} ms, {bandwidth / 1e6:.1f} MB/s"
        )

    async def run(self, client: aiohttp.ClientSession, ask: PrefillAsk, upstream: Upstream) -> RemotePrefillResult:
        """Prefill the request remotely, as the router decided. Past twice the time a local prefill was estimated to
        take, the remote path has lost even if that estimate was off by half: a slow or stalled relay costs the
        request at most that before it prefills here."""
        return await self._run(client, ask, upstream, max(self.min_deadline_s, 2.0 * ask.local_s))

    async def _run(
        self, client: aiohttp.ClientSession, ask: PrefillAsk, upstream: Upstream, deadline_s: float
    ) -> RemotePrefillResult:
        """Prefill and save there, download, restore here, all within `deadline_s`; whatever happens, the file goes
        on both sides."""
        self._seq += 1
        name = slot_file_name(ask.session_id, self._seq, "pp")
        dest = self.slot_dir / name
        slot = ask.at.slot or 0
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(deadline_s):
                if ask.slot_busy:
                    raise SlotError(f"{ask.at.profile} slot {slot} is busy with another request")
                prefilled = await self.relay.prefill(client, ask.path, ask.body, name, timeout_s=deadline_s)
                t1 = time.perf_counter()
                if not 0 < prefilled.n_written <= self.max_bytes:
                    raise RelayError(f"the relay saved {prefilled.n_written} bytes (at most {self.max_bytes})", "size")
                # Exactly the size the relay said it saved: a relay that sends more is cut off there.
                got = await self.relay.download(client, name, dest, prefilled.n_written, timeout_s=deadline_s)
                if got.bytes != prefilled.n_written:
                    raise RelayError(f"downloaded {got.bytes} of the {prefilled.n_written} bytes saved", "size")
                t2 = time.perf_counter()
                timeout = aiohttp.ClientTimeout(total=10.0 + prefilled.n_saved * 0.0005)
                await restore_slot(client, upstream, slot, name, timeout, prefilled.n_saved)
                t3 = time.perf_counter()
        except (aiohttp.ClientError, TimeoutError, ValueError, TypeError, OSError, RelayError, SlotError) as exc:
            self.counts["failed"] += 1
            message = str(exc) or type(exc).__name__
            if isinstance(exc, TimeoutError):
                message = f"gave up after {deadline_s:.0f} s, twice the local prefill's estimate"
            log.warning("remote prefill via %s failed: %s", self.relay.base_url, message)
            return RemotePrefillResult(False, 0, 0.0, 0.0, 0.0, 0.0, 0, message, fallback_reason(exc))
        finally:
            await asyncio.to_thread(dest.unlink, True)
            await self._delete_there(client, name)  # also after a failed call: the save may have happened
        self.counts["ok"] += 1
        server_s = (prefilled.prompt_ms + prefilled.save_ms) / 1000.0
        self.costs.observe(
            RemoteMeasurement(
                tokens=prefilled.n_saved,
                prompt_n=prefilled.prompt_n,
                prefill_s=prefilled.prompt_ms / 1000.0,
                round_trip_s=(t1 - t0) - server_s,
                save_s=prefilled.save_ms / 1000.0,
                file_bytes=got.bytes,
                transfer_s=t2 - t1,
                restore_s=t3 - t2,
            )
        )
        return RemotePrefillResult(
            True,
            prefilled.n_saved,
            prefilled.prompt_ms / 1000.0,
            prefilled.save_ms / 1000.0,
            t2 - t1,
            t3 - t2,
            got.bytes,
        )

    async def _delete_there(self, client: aiohttp.ClientSession, name: str) -> None:
        try:
            await self.relay.delete(client, name)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("could not delete %s at %s: %s", name, self.relay.base_url, exc)


def fallback_reason(exc: BaseException) -> str:
    """One word for why a remote prefill fell back: a metrics label, so a small fixed set."""
    if isinstance(exc, TimeoutError):  # aiohttp's own timeouts are TimeoutErrors too
        return "timeout"
    if isinstance(exc, RelayError):
        return exc.code
    if isinstance(exc, SlotError):
        return "local_slot"
    if isinstance(exc, aiohttp.ClientError | ConnectionError):
        return "unreachable"
    if isinstance(exc, OSError):
        return "local_disk"
    return "bad_answer"


def sweep_partial_downloads(slot_dir: Path) -> int:
    """Downloads cut off by a crash leave hidden partial files in the local slot directory: gone at start."""
    swept = 0
    for leftover in slot_dir.glob(f"{PARTIAL_PREFIX}*"):
        leftover.unlink(missing_ok=True)
        swept += 1
    return swept


REMOTE_PREFILL = web.AppKey("remote_prefill", RemotePrefill)


@dataclass(frozen=True, slots=True)
class RemotePrefillSettings:
    """`serve --pp-server URL` (the kv-relay beside the remote llama-server) and how to price it."""

    relay_url: str
    key: str = field(repr=False)  # never in a log line or a traceback's repr
    policy: RemotePrefillPolicy
    model_sha256: str | None = None  # this side's GGUF hash, when the proxy cannot read the file (attached profiles)


async def start_remote_prefill(
    settings: RemotePrefillSettings,
    client: aiohttp.ClientSession,
    model_path: str | None,
    slot_dir: Path | None,
    say: Callable[[str], None],
) -> RemotePrefill:
    """Check and connect at start: this side's model hash (`--pp-model-sha256`, else the GGUF the profiles run:
    the launched model, or the attached profiles' /props model_path when that file is on this machine), the
    slot directory it restores from, and the relay's model."""
    if slot_dir is None:
        raise ConfigError(
            "--pp-server restores slot files here: attached profiles need --slot-dir (their shared --slot-save-path)"
        )
    sha = settings.model_sha256
    if sha is None:
        if not model_path or not await asyncio.to_thread(Path(model_path).is_file):
            raise ConfigError(
                f"--pp-server: the profiles' model file {model_path or '(unknown)'} is not readable here to hash; "
                "give --pp-model-sha256 HEX (sha256sum of the GGUF)"
            )
        say(f"remote prefill: hashing {model_path} ...")
        sha = await asyncio.to_thread(file_sha256, Path(model_path))
    swept = await asyncio.to_thread(sweep_partial_downloads, slot_dir)
    if swept:
        say(f"remote prefill: removed {swept} partial download(s) left in {slot_dir}")
    remote = RemotePrefill(RelayClient(settings.relay_url, settings.key, sha), RemoteCosts(settings.policy), slot_dir)
    say(await remote.connect(client))
    return remote
