"""Moving a session's KV slot from one llama-server to another: save it on the source, get the file to the target,
restore it there.

`SlotMover` is the seam the router's effects call; `SharedDirMover` is the case where both servers write slot files into
one directory (the same host, or a shared filesystem); `RelayMover` moves between hosts, a kv-relay beside each server
(`serve --relay SERVER_URL=RELAY_URL`): save on the source into its own slot directory, stream the file from the
source's relay into the target's (sha256-checked there, size-bounded), restore on the target, delete it on both sides.
`PairMover` picks per pair of servers: those without a relay move through the shared directory, those with one through
their relays; a pair of one of each cannot hand over (the session re-prefills). Both are priced by the same cost model
(`kv/costs.py`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import aiohttp

from adaptive_spec.errors import ConfigError, ProfileMismatchError
from adaptive_spec.kv.relay_client import RelayClient, RelayError
from adaptive_spec.kv.slot_files import model_mismatch
from adaptive_spec.kv.slots import SlotError, check_written, restore_slot, save_slot
from adaptive_spec.llama.upstreams import Upstream, UpstreamTable

log = logging.getLogger(__name__)
_PROBE_BYTES = 256 << 10
_DELETE_S = 5.0  # a delete is one unlink; a file a relay kept then, it sweeps (in 5 minutes, or when it starts)


@dataclass(frozen=True, slots=True)
class MoveRequest:
    """One slot file's move: saved from `from_slot` of `source` as `name`, restored into `into_slot` of `target`.
    A save that wrote fewer than `min_tokens` tokens captured another session's KV, and is not restored."""

    source: Upstream
    from_slot: int
    target: Upstream
    into_slot: int
    name: str
    timeout_s: float  # each slot action's deadline
    min_tokens: int

    @property
    def timeout(self) -> aiohttp.ClientTimeout:
        return aiohttp.ClientTimeout(total=self.timeout_s)


@dataclass(frozen=True, slots=True)
class MoveTimes:
    n_saved: int
    save_s: float
    restore_s: float
    transfer_s: float = 0.0  # a mover between hosts: the file's trip from one host to the other
    bytes: int = 0  # the slot file's size, when it crossed hosts (bytes per token, bandwidth: learned from it)


class SlotMover(Protocol):
    def can_move(self, source: Upstream, target: Upstream) -> bool:
        """Whether a slot file saved by `source` can be restored by `target`."""
        ...

    def transfers(self, source: Upstream, target: Upstream) -> bool:
        """Whether the file crosses hosts between these two (the cost model adds its transfer time)."""
        ...

    async def move(self, client: aiohttp.ClientSession, move: MoveRequest) -> MoveTimes:
        """Save, transfer, restore; raises SlotError (or aiohttp's errors) on any failure."""
        ...

    async def discard(self, name: str) -> None:
        """Remove the file wherever the move left it (whatever the outcome)."""
        ...


class SharedDirMover:
    """Both servers save into and restore from one `--slot-save-path` directory."""

    def __init__(self, slot_dir: Path) -> None:
        self.slot_dir = slot_dir

    def can_move(self, source: Upstream, target: Upstream) -> bool:
        # A router-mode preset (`URL#MODEL`) takes no slot actions.
        return source.upstream_model is None and target.upstream_model is None

    def transfers(self, source: Upstream, target: Upstream) -> bool:
        return False

    async def move(self, client: aiohttp.ClientSession, move: MoveRequest) -> MoveTimes:
        t0 = time.perf_counter()
        n_saved, n_written = await save_slot(
            client, move.source, move.from_slot, move.name, move.timeout, move.min_tokens
        )
        t1 = time.perf_counter()
        await self._check_file(move.source, move.name, n_written)
        await restore_slot(client, move.target, move.into_slot, move.name, move.timeout, n_saved)
        return MoveTimes(n_saved, t1 - t0, time.perf_counter() - t1)

    async def discard(self, name: str) -> None:
        await asyncio.to_thread((self.slot_dir / name).unlink, missing_ok=True)

    async def _check_file(self, source: Upstream, name: str, n_written: object) -> None:
        """The saved file must be whole before another server restores it: llama-server aborts (GGML_ASSERT in
        state_seq_load_file) on a slot file that is cut short, say by a full disk."""
        await asyncio.to_thread(check_written, self.slot_dir / name, n_written, source.label)


@dataclass(frozen=True, slots=True)
class RelayMoverSettings:
    """`serve --relay SERVER_URL=RELAY_URL` (repeatable) and the relays' key."""

    relays: tuple[tuple[str, str], ...]  # (llama-server base URL, its kv-relay's URL)
    key: str
    max_bytes: int = 64 << 30


class RelayMover:
    """Slot files between servers that each have a relay beside them (a relay serves its server's slot directory)."""

    def __init__(self, relays: Mapping[str, RelayClient], max_bytes: int = 64 << 30) -> None:
        self.relays, self.max_bytes = dict(relays), max_bytes
        # A move's file is deleted where it went, on discard: the session it was for, and both relays.
        self._pending: dict[str, tuple[aiohttp.ClientSession, RelayClient, RelayClient]] = {}

    def relay_of(self, upstream: Upstream) -> RelayClient | None:
        # A router-mode preset (`URL#MODEL`) takes no slot actions.
        return None if upstream.upstream_model is not None else self.relays.get(upstream.base_url)

    def can_move(self, source: Upstream, target: Upstream) -> bool:
        return self.relay_of(source) is not None and self.relay_of(target) is not None

    def transfers(self, source: Upstream, target: Upstream) -> bool:
        there, here = self.relay_of(source), self.relay_of(target)
        # Two servers behind one relay share its slot directory: nothing crosses hosts.
        return there is not None and here is not None and there.base_url != here.base_url

    async def move(self, client: aiohttp.ClientSession, move: MoveRequest) -> MoveTimes:
        source, target, name = move.source, move.target, move.name
        there, here = self.relay_of(source), self.relay_of(target)
        if there is None or here is None:
            raise SlotError(f"{source.label} and {target.label} do not both have a kv-relay (serve --relay)")
        problem = model_mismatch(there.model_sha256, here.model_sha256, f"the relay {there.base_url}")
        if problem:
            raise SlotError(f"relay {here.base_url}: {problem}")
        self._pending[name] = (client, there, here)
        t0 = time.perf_counter()
        n_saved, n_written = await save_slot(client, source, move.from_slot, name, move.timeout, move.min_tokens)
        t1 = time.perf_counter()
        copied = 0
        if there.base_url != here.base_url:
            try:  # as long as bytes keep crossing: the router priced this move from the link it measured
                got = await there.copy_to(client, name, here, self.max_bytes, move.timeout_s)
            except RelayError as exc:
                raise SlotError(str(exc)) from exc
            if isinstance(n_written, int) and got.bytes != n_written:
                raise SlotError(f"{here.base_url} received {got.bytes} of the {n_written} bytes {source.label} saved")
            copied = got.bytes
        t2 = time.perf_counter()
        await restore_slot(client, target, move.into_slot, name, move.timeout, n_saved)
        t3 = time.perf_counter()
        return MoveTimes(n_saved, t1 - t0, t3 - t2, transfer_s=t2 - t1, bytes=copied)

    async def discard(self, name: str) -> None:
        """Delete the move's file on both relays at once, each given `_DELETE_S`: the request waits for this, and a
        relay that stalled the move would stall its delete as long again."""
        pending = self._pending.pop(name, None)
        if pending is None:
            return
        client, there, here = pending
        relays = {there.base_url: there, here.base_url: here}.values()
        await asyncio.gather(*(self._delete(client, relay, name) for relay in relays))

    @staticmethod
    async def _delete(client: aiohttp.ClientSession, relay: RelayClient, name: str) -> None:
        try:
            await relay.delete(client, name, _DELETE_S)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("could not delete %s at %s: %s", name, relay.base_url, exc or type(exc).__name__)


class PairMover:
    """Picks the way per pair of servers: both with relays → the relays; neither → the shared slot directory."""

    def __init__(self, relays: RelayMover, shared: SlotMover | None) -> None:
        self.relays, self.shared = relays, shared

    def _pick(self, source: Upstream, target: Upstream) -> SlotMover | None:
        if self.relays.can_move(source, target):
            return self.relays
        local = source.base_url not in self.relays.relays and target.base_url not in self.relays.relays
        if local and self.shared is not None and self.shared.can_move(source, target):
            return self.shared
        return None

    def can_move(self, source: Upstream, target: Upstream) -> bool:
        return self._pick(source, target) is not None

    def transfers(self, source: Upstream, target: Upstream) -> bool:
        mover = self._pick(source, target)
        return mover is not None and mover.transfers(source, target)

    async def move(self, client: aiohttp.ClientSession, move: MoveRequest) -> MoveTimes:
        mover = self._pick(move.source, move.target)
        if mover is None:
            raise SlotError(f"no way to move a slot file from {move.source.label} to {move.target.label}")
        return await mover.move(client, move)

    async def discard(self, name: str) -> None:
        await self.relays.discard(name)
        if self.shared is not None:
            await self.shared.discard(name)


async def start_relay_mover(
    settings: RelayMoverSettings,
    client: aiohttp.ClientSession,
    table: UpstreamTable,
    shared: SlotMover | None,
    say: Callable[[str], None],
) -> tuple[PairMover, float]:
    """At start: every relay names a server the proxy serves, answers with the key, and runs the same GGUF as the
    others (else refuse, naming both relays and hashes); its link is probed. Returns the mover and the slowest
    link's bandwidth (bytes/s: the handoff's price until moves measure it)."""
    servers = {u.base_url for u in table.all()}
    found: list[tuple[str, str, str, str, float, float]] = []  # server, relay, sha256, model, round trip, bytes/s
    for server, relay_url in settings.relays:
        if server not in servers:
            raise ConfigError(f"--relay {server}={relay_url}: no --profile serves at {server}")
        probe = RelayClient(relay_url, settings.key, "")
        try:
            model, round_trip_s = await probe.model(client)
            bandwidth = await probe.probe(client, _PROBE_BYTES)
        except (aiohttp.ClientError, TimeoutError, RelayError, ValueError) as exc:
            raise ProfileMismatchError(f"--relay {server}={relay_url}: {exc or type(exc).__name__}") from exc
        found.append((server, relay_url, str(model.get("sha256")), str(model.get("model")), round_trip_s, bandwidth))
    first = found[0]
    for other in found[1:]:
        if other[2] != first[2]:
            raise ProfileMismatchError(
                f"the kv-relays serve different models: {first[1]} (beside {first[0]}) runs sha256 {first[2]}, "
                f"{other[1]} (beside {other[0]}) runs sha256 {other[2]}; a KV cache moves only between servers "
                "running the same GGUF"
            )
    slowest = min(found, key=lambda f: f[5])
    relays = {server: RelayClient(url, settings.key, sha) for server, url, sha, *_ in found}
    say(
        f"KV moves between hosts: {len(found)} relays, one model ({first[3]}, sha256 {first[2][:12]}…); slowest link "
        f"{slowest[1]}: {slowest[4] * 1000:.0f} ms, {slowest[5] / 1e6:.1f} MB/s"
    )
    return PairMover(RelayMover(relays, settings.max_bytes), shared), slowest[5]
