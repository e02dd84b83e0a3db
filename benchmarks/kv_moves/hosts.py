"""KV moves between hosts that are hosts: two llama-servers, each with its kv-relay, in network namespaces of their
own (a veth each into one switch, `tests/support/processes/hosts.py`), the mover in this process on the same switch
(the proxy's place: the file passes through it). Per prompt length: the prefill on A, the move A → B over the bare
veth and over the link held to a rate by a token bucket (`tc … tbf`), the request on B that follows; then A's link
pulled (`ip link set eth0 down`) while the file is on its way, what that costs, and B's prefill of the same tokens.

Run:  .venv/bin/python -m benchmarks.kv_moves.hosts [--models tiny,qwen] [--tokens 1000,3500]
                                          [--out benchmarks/results/kv_hosts.json]

Needs root (network namespaces) and iproute2. `-t 1`, one slot each, separate slot directories; the move's deadline
is the proxy's own (`SlotMove.timeout_s` and the mover's minimum link speed).
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from tests.support.processes.hosts import Hosts
from tests.support.processes.relay import RelayProcess
from tests.support.processes.servers import LlamaServer, http_json, wait_until

from adaptive_spec.kv.movers import MoveRequest, RelayMover
from adaptive_spec.kv.moves import SlotAt, SlotMove
from adaptive_spec.kv.relay_client import RelayClient
from adaptive_spec.kv.slot_files import file_sha256
from adaptive_spec.kv.slots import SlotError
from adaptive_spec.llama.binary.which import find_llama_server
from adaptive_spec.llama.upstreams import Upstream
from benchmarks.kv_moves.common import KEY, model, prompt, run_main, server_args

RATES = (None, "100mbit", "10mbit")  # None: the bare veth
PULLED_AT_S = 0.5  # A's link goes down this long after the saved file appears
PULL_RATE = "4mbit"  # slow enough that the file is still on its way then


class Rig:
    def __init__(self, hosts: Hosts, gguf: Path, args: tuple[str, ...], home: Path) -> None:
        self.hosts, self.slot_dirs = hosts, [home / side for side in ("a", "b")]
        self.servers: list[LlamaServer] = []
        self.relays: list[RelayProcess] = []
        binary = find_llama_server(None)
        for name, slots in zip(("a", "b"), self.slot_dirs, strict=True):
            slots.mkdir(parents=True)
            where: dict[str, Any] = {"host": hosts.address(name), "wrap": hosts.run(name)}
            server = LlamaServer(binary, gguf, *args, "--slot-save-path", str(slots), log_dir=home / "logs", **where)
            self.servers.append(server)
            self.relays.append(RelayProcess(slots, gguf, KEY, server=server.url, **where))
        sha = file_sha256(gguf)
        pairs = zip(self.servers, self.relays, strict=True)
        self.mover = RelayMover({s.url: RelayClient(r.base, KEY, sha) for s, r in pairs})
        self.a, self.b = (Upstream("bench", s.url, replica=i) for i, s in enumerate(self.servers))

    def stop(self) -> None:
        for relay in self.relays:
            relay.stop()
        for server in self.servers:
            server.stop()

    def chat(self, side: int, body: dict[str, Any]) -> dict[str, Any]:
        return dict(http_json(self.servers[side].url + "/v1/chat/completions", body, timeout=3600)["timings"])

    def erase_b(self) -> None:
        http_json(self.servers[1].url + "/slots/0?action=erase", {})

    def request(self, tokens: int, name: str) -> MoveRequest:
        timeout_s = SlotMove("bench", SlotAt("bench", 0, 0), SlotAt("bench", 1, 0), tokens).timeout_s
        return MoveRequest(self.a, 0, self.b, 0, name, timeout_s=timeout_s, min_tokens=1)


async def _move(rig: Rig, tokens: int, name: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as client:
        try:
            moved = await rig.mover.move(client, rig.request(tokens, name))
        finally:
            await rig.mover.discard(name)
    return {
        "tokens": moved.n_saved,
        "slot_file_bytes": moved.bytes,
        "bytes_per_token": round(moved.bytes / max(1, moved.n_saved), 1),
        "save_ms": round(moved.save_s * 1000, 1),
        "transfer_ms": round(moved.transfer_s * 1000, 1),
        "transfer_mb_per_s": round(moved.bytes / max(1e-6, moved.transfer_s) / 1e6, 2),
        "restore_ms": round(moved.restore_s * 1000, 1),
        "move_ms": round((moved.save_s + moved.transfer_s + moved.restore_s) * 1000, 1),
    }


async def _pulled(rig: Rig, tokens: int, name: str) -> dict[str, Any]:
    """The move with A's link pulled mid-transfer: how long until it is given up, how far it got."""
    async with aiohttp.ClientSession() as client:
        t0 = time.perf_counter()
        move = asyncio.create_task(rig.mover.move(client, rig.request(tokens, name)))
        saved = rig.slot_dirs[0] / name
        await asyncio.to_thread(wait_until, lambda: saved.exists() or move.done(), 120, "the saved file", 0.005)
        await asyncio.sleep(PULLED_AT_S)
        size = saved.stat().st_size
        await asyncio.to_thread(rig.hosts.link_down, "a")
        pulled_s = time.perf_counter() - t0
        try:
            await move
            error = "moved anyway"
        except SlotError as exc:
            error = str(exc)
        failed_s = time.perf_counter() - t0
        await rig.mover.discard(name)
        discarded_s = time.perf_counter() - t0  # A's delete given up: its link is down
    across = re.search(r"(\d+) bytes", error)
    return {
        "slot_file_bytes": size,
        "bytes_across": int(across.group(1)) if across else None,
        "pulled_at_s": round(pulled_s, 2),
        "given_up_at_s": round(failed_s, 2),
        "answered_at_s": round(discarded_s, 2),
        "error": error,
    }


def _one(rig: Rig, run: int, chars: int) -> dict[str, Any]:
    body: dict[str, Any] = {"messages": prompt(run, chars), "temperature": 0, "max_tokens": 16, "id_slot": 0}
    prefill = rig.chat(0, {**body, "max_tokens": 1})
    tokens = int(prefill["prompt_n"]) + int(prefill["cache_n"])
    row: dict[str, Any] = {"tokens": tokens, "prefill_on_a_ms": round(prefill["prompt_ms"], 1), "links": []}
    for i, rate in enumerate(RATES):
        rig.hosts.rate_limit("a", rate)
        try:
            moved = asyncio.run(_move(rig, tokens, f"as-bench-{run}-{i}.bin"))
        except SlotError as exc:
            moved = {"failed": str(exc)}
        finally:
            rig.hosts.rate_limit("a", None)
        after = rig.chat(1, body) if "failed" not in moved else {}
        row["links"].append({"rate": rate or "veth", **moved, "then_on_b": after})
    rig.hosts.rate_limit("a", PULL_RATE)
    try:
        row["pulled"] = {"rate": PULL_RATE, **asyncio.run(_pulled(rig, tokens, f"as-bench-{run}-pulled.bin"))}
    finally:
        rig.hosts.link_up("a")
        rig.hosts.rate_limit("a", None)
    # What the pulled move left on A (its relay sweeps it later); deleted now, through the relay.
    status, _, _ = rig.relays[0].call("DELETE", f"/relay/slots/as-bench-{run}-pulled.bin")
    row["pulled"]["left_on_a"] = status == 204
    rig.erase_b()
    row["prefill_on_b_ms"] = round(rig.chat(1, body)["prompt_ms"], 1)  # what the pulled move cost: B prefills
    return row


def bench(models: list[str], tokens: list[int], home: Path) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    hosts = Hosts(["a", "b"])
    try:
        for model_name in models:
            gguf, chars_per_token = model(model_name, home)
            rig = Rig(hosts, gguf, server_args(tokens), home / model_name)
            try:
                for run, n in enumerate(tokens):
                    rows.append({"model": model_name, **_one(rig, run, int(n * chars_per_token))})
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            finally:
                rig.stop()
    finally:
        hosts.close()
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| model | tokens | link | save | transfer (MB/s) | restore | move | then on B | prefill on A |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for link in r["links"]:
            if "failed" in link:
                out.append(f"| {r['model']} | {r['tokens']:,} | {link['rate']} | failed: {link['failed']} |")
                continue
            b = link["then_on_b"]
            out.append(
                f"| {r['model']} | {r['tokens']:,} | {link['rate']} | {link['save_ms']:.1f} ms | "
                f"{link['transfer_ms']:,.1f} ms ({link['transfer_mb_per_s']}) | {link['restore_ms']:.1f} ms | "
                f"{link['move_ms']:,.1f} ms | {b['prompt_n']} tok, {b['prompt_ms']:.0f} ms "
                f"(cache_n {b['cache_n']:,}) | {r['prefill_on_a_ms']:,.0f} ms |"
            )
    out += [
        "",
        "| model | tokens | link | file | pulled at | across | given up at | answered | left on A | B prefills |",
    ]
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p = r["pulled"]
        out.append(
            f"| {r['model']} | {r['tokens']:,} | {p['rate']} | {p['slot_file_bytes']:,} B | {p['pulled_at_s']} s | "
            f"{p['bytes_across'] or 0:,} B | {p['given_up_at_s']} s | {p['answered_at_s']} s | "
            f"{'yes' if p['left_on_a'] else 'no'} | {r['prefill_on_b_ms']:,.0f} ms |"
        )
    return "\n".join(out)


def main() -> None:
    run_main("benchmarks.kv_moves.hosts", __doc__, "benchmarks/results/kv_hosts.json", bench, table)


if __name__ == "__main__":
    main()
