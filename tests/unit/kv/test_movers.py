"""KV moves between hosts without a server: the transfer term of the handoff cost (priors, the link probe, learned
from moves), the replica choice it changes, which way `PairMover` takes per pair of servers, and `--relay` parsing."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

import aiohttp
import pytest

from adaptive_spec.errors import ConfigError
from adaptive_spec.kv.effects import KvEffects
from adaptive_spec.kv.movers import MoveRequest, MoveTimes, PairMover, RelayMover, SharedDirMover
from adaptive_spec.kv.movers_options import KEY_ENV, relay_settings
from adaptive_spec.kv.relay_client import RelayClient, _Passing, _unless_stalled
from adaptive_spec.llama.upstreams import Upstream, UpstreamTable
from adaptive_spec.policy.model import Policy
from adaptive_spec.routing.contract import RouteRequest
from adaptive_spec.routing.router import Router
from adaptive_spec.routing.speeds import SpeedModel
from adaptive_spec.telemetry.records import Timings
from tests.support.routing import kv_effects, make_router, request, routed, serve

SHA = "a" * 64


def _speeds() -> SpeedModel:
    p = Policy()
    return SpeedModel(p.estimator, p.handoff, {"plain": ("none",)})


def test_a_move_between_hosts_pays_bytes_per_token_times_tokens_over_the_bandwidth() -> None:
    model = _speeds()
    same_host = model.handoff_s(10_000)
    # Priors: 120 kB a token over 100 MB/s, so 10,000 tokens are 12 s on the wire.
    assert model.handoff_s(10_000, across_hosts=True) == pytest.approx(same_host + 12.0)
    model.link.observe_link(1e9)  # the start-up probe: 1 GB/s replaces the bandwidth prior
    assert model.link.transfer_s(10_000) == pytest.approx(1.2)
    model.link.observe_transfer(1000, 528_000, 0.00528)  # one file: 528 bytes a token, at 100 MB/s
    assert model.link.bytes_per_token() == pytest.approx(528.0)
    # The link: the probe's prior (worth two moves) and the one move, averaged as seconds per byte.
    expected_s_per_byte = (2 * 1e-9 + 0.00528 / 528_000) / 3
    assert model.link.transfer_s(10_000) == pytest.approx(10_000 * 528 * expected_s_per_byte)
    for _ in range(40):
        model.link.observe_transfer(1000, 528_000, 0.00528)
    assert model.link.bandwidth_bytes_per_s() == pytest.approx(100e6, rel=0.1)  # the prior, faded
    assert model.handoff_s(10_000, across_hosts=True) > model.handoff_s(10_000)


def test_small_files_teach_bytes_per_token_but_not_the_link() -> None:
    model = _speeds()
    model.link.observe_link(50e6)
    model.link.observe_transfer(100, 52_800, 5.0)  # 52 kB in 5 s: a round trip's worth, not the link's speed
    assert model.link.bytes_per_token() == pytest.approx(528.0)
    assert model.link.bandwidth_bytes_per_s() == pytest.approx(50e6)


class _Mover:
    """A slot mover between hosts whose saves always work; `transfers` says whether the pair crosses hosts."""

    def __init__(self, transfers: bool) -> None:
        self.crosses = transfers

    def can_move(self, source: Upstream, target: Upstream) -> bool:
        return True

    def transfers(self, source: Upstream, target: Upstream) -> bool:
        return self.crosses

    async def move(self, client: aiohttp.ClientSession, move: MoveRequest) -> MoveTimes:
        return MoveTimes(4000, 0.01, 0.01, transfer_s=0.5, bytes=50_000_000)

    async def discard(self, name: str) -> None:
        return None


async def _overloaded(mover: _Mover, client: aiohttp.ClientSession | None = None) -> tuple[Router, KvEffects]:
    """Session `s` (4,000 tokens) in slot 1 of replica 0, whose other slot is busy with two more queued; replica 1
    idle. The router, and its effects (the request path's mover too)."""
    table = UpstreamTable([Upstream("plain", "http://a:1"), Upstream("plain", "http://b:1")])
    effects = kv_effects(table, mover=mover, client=client)
    router = make_router(table, {"plain": 2}, {"plain": ("none",)}, effects=effects)
    timings = Timings(prompt_n=3990, predicted_n=10, predicted_ms=100.0, prompt_ms=1000.0)
    assert (await serve(router, _request(1, client_slot=1), timings)).replica == 0
    for other in ("x", "y", "z"):
        router.load.started("plain", 0, other, 0)
    return router, effects


def test_the_transfer_is_priced_in_the_choice_to_move_a_session_off_an_overloaded_replica() -> None:
    near, _ = asyncio.run(_overloaded(_Mover(transfers=False)))
    moved = near.choose(_request())[0]
    assert (moved.replica, moved.replica_kind, moved.handoff) == (1, "rebalanced", True), moved.reason
    far, _ = asyncio.run(_overloaded(_Mover(transfers=True)))
    far.speeds.link.observe_link(10_000.0)  # 10 kB/s: 4,000 tokens × 120 kB a token would take 13 hours
    stays = far.choose(_request())[0]
    assert (stays.replica, stays.replica_kind, stays.handoff) == (0, "stay", False), stays.reason
    assert "stays though overloaded" in stays.reason and "hands its KV over ≈ 48" in stays.reason


@pytest.mark.asyncio(loop_scope="function")
async def test_a_move_between_hosts_teaches_the_transfer_terms() -> None:
    async with aiohttp.ClientSession() as client:
        router, effects = await _overloaded(_Mover(transfers=True), client)
        router.speeds.link.observe_link(1e11)  # 4,000 tokens at the prior 120 kB a token: 5 ms
        moved = await routed(router, _request(client_slot=0), effects)
    assert moved.decision.handoff, moved.decision.reason
    result = moved.handoff
    assert result is not None and result.ok and result.transfer_s == 0.5 and result.bytes == 50_000_000
    assert router.speeds.link.bytes_per_token() == pytest.approx(50_000_000 / 4000)


def _request(turns: int = 2, client_slot: int | None = None) -> RouteRequest:
    body = {"messages": [{"role": "user", "content": "x" * 400}]}
    return request(body, "s", turns=turns, copy_share=0.0, body_bytes=400, client_slot=client_slot)


def test_the_pair_mover_picks_the_relays_or_the_shared_directory_per_pair(tmp_path: Path) -> None:
    a, b, c, d = (Upstream("plain", f"http://{h}:1") for h in "abcd")
    relays = {
        a.base_url: RelayClient("http://ra:9", "k", SHA),
        b.base_url: RelayClient("http://rb:9", "k", SHA),
        c.base_url: RelayClient("http://rb:9", "k", SHA),  # c shares b's host and slot directory
    }
    mover = PairMover(RelayMover(relays), SharedDirMover(tmp_path))
    assert mover.can_move(a, b) and mover.transfers(a, b)
    assert mover.can_move(b, c) and not mover.transfers(b, c)  # one relay: nothing crosses hosts
    assert mover.can_move(d, d) and not mover.transfers(d, d)  # no relays: the shared slot directory
    assert not mover.can_move(a, d) and not mover.can_move(d, b)  # one with a relay, one without: re-prefill
    preset = Upstream("plain", a.base_url, upstream_model="m")
    assert not mover.can_move(preset, b)
    assert not PairMover(RelayMover(relays), None).can_move(d, d)


def _args(*relay: str, key_file: Path | None = None, profile: bool = True) -> argparse.Namespace:
    return argparse.Namespace(relay=list(relay), relay_key_file=key_file, profile=["p=http://a:1"] if profile else [])


def test_relay_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KEY_ENV, raising=False)
    assert relay_settings(_args()) is None
    with pytest.raises(ConfigError, match="needs the relays' key"):
        relay_settings(_args("http://a:1=http://ra:9"))
    key = tmp_path / "key"
    key.write_text("secret\n")
    settings = relay_settings(_args("http://a:1/=http://ra:9/", "http://b:1=http://rb:9", key_file=key))
    assert settings is not None and settings.key == "secret"
    assert settings.relays == (("http://a:1", "http://ra:9"), ("http://b:1", "http://rb:9"))
    monkeypatch.setenv(KEY_ENV, "from-env")
    assert (relay_settings(_args("http://a:1=http://ra:9")) or settings).key == "from-env"
    for bad, message in [
        (("http://a:1",), "expected SERVER_URL=RELAY_URL"),
        (("a:1=http://ra:9",), "is not an http"),
        (("http://a:1=http://ra:9", "http://a:1=http://rb:9"), "given twice"),
    ]:
        with pytest.raises(ConfigError, match=message):
            relay_settings(_args(*bad))
    with pytest.raises(ConfigError, match="attached profiles"):
        relay_settings(_args("http://a:1=http://ra:9", profile=False))


@pytest.mark.asyncio
async def test_a_copy_between_relays_goes_on_while_bytes_cross_and_is_given_up_once_they_stop() -> None:
    """A slow link copies for as long as it takes (the router priced the move from the link it measured): only
    `stall_s` without a byte gives it up. Before, one deadline (the slot action's plus the file at 5 MB/s) gave up
    a 60 MB head on a 10 Mbit/s link 24.5 s in, 29.2 MB across, and the turn prefilled all of it after."""
    stall_s = 0.2
    passing = _Passing()

    async def dripping() -> dict[str, object]:
        for _ in range(12):  # 12 × 0.1 s: six times the stall window, a byte every tenth of a second
            await asyncio.sleep(0.1)
            passing.bytes += 1
        return {"bytes": passing.bytes}

    assert await _unless_stalled(asyncio.ensure_future(dripping()), passing, stall_s) == {"bytes": 12}

    stalled, cancelled = _Passing(), asyncio.Event()

    async def stopping() -> dict[str, object]:
        stalled.bytes += 1
        try:
            await asyncio.sleep(3600)  # a pulled cable: nothing more crosses
        finally:
            cancelled.set()
        raise AssertionError("unreachable")

    t0 = asyncio.get_running_loop().time()
    with pytest.raises(TimeoutError):
        await _unless_stalled(asyncio.ensure_future(stopping()), stalled, stall_s)
    assert stall_s <= asyncio.get_running_loop().time() - t0 < 3 * stall_s and cancelled.is_set()
