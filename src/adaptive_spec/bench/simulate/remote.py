"""`bench --simulate pp-remote`: the arithmetic of prefilling a long prompt on a faster remote server and moving its KV
cache back for local decode, at scales this machine cannot run.

Pure arithmetic: every figure comes from a stated assumption (printed with the tables), none from a measurement here
except where marked "measured".

Local path:  prompt tokens ÷ local prefill speed.
Remote path: start-up (round trips, opening the slot) + prompt ÷ remote prefill speed + slot save (bytes ÷ write
             speed) + transfer (bytes ÷ link speed) + restore (bytes ÷ read speed).
Bytes = tokens × KV bytes per token; KV bytes per token = layers × KV heads × head dim × 2 (K and V) × bytes per
element of the cache type. The tail a request adds after the prefilled prefix is prefilled locally either way.
"""

from __future__ import annotations

from dataclasses import dataclass

from adaptive_spec.kv.costs import LinkCosts

# Bytes per element of llama.cpp's KV cache types (`--cache-type-k/-v`): q8_0 and q4_0 store blocks of 32 values
# with one f16 scale (34 and 18 bytes a block).
CACHE_TYPES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}


@dataclass(frozen=True, slots=True)
class Architecture:
    name: str
    layers: int  # layers with a KV cache (all of them for a dense transformer)
    kv_heads: int
    head_dim: int

    def kv_bytes_per_token(self, cache_type: str) -> float:
        return self.layers * self.kv_heads * self.head_dim * 2 * CACHE_TYPES[cache_type]


# A 27B-class dense model with grouped-query attention (Gemma-2/Qwen-style 27 to 32B: 64 layers, 128-dim heads; 8 KV
# heads, and a 4-KV-head variant). The check of the formula on a model measured here: Qwen2.5-Coder-0.5B (24 layers,
# 2 KV heads, head dim 64, f16) gives 12,288 bytes a token; its slot files measured 12.3 kB a token.
ARCH_27B = Architecture("27B-class dense, 64 layers × 8 KV heads × 128", 64, 8, 128)
ARCH_27B_GQA4 = Architecture("27B-class dense, 64 layers × 4 KV heads × 128", 64, 4, 128)
QWEN_05B = Architecture("Qwen2.5-0.5B, 24 layers × 2 KV heads × 64", 24, 2, 64)


@dataclass(frozen=True, slots=True)
class Assumptions:
    prompt_tokens: int = 50_000  # the public proposal's coding prompt
    local_prefill_tps: float = 10.0  # the proposal's weak local box
    remote_prefill_tps: float = 5_000.0  # a 27B on one big GPU, averaged over a 50k prompt (assumed)
    startup_s: float = 1.0  # round trips to the remote and its relay, opening the slot (assumed)
    save_bytes_per_s: float = 340e6  # slot save to disk: 91.5 MB in 0.27 s, measured here (CPU box, page cache)
    restore_bytes_per_s: float = 1e9  # slot restore from disk (assumed; 91.5 MB in 16 ms here, from page cache)
    links_gbit: tuple[float, ...] = (1.0, 10.0)

    def lines(self) -> list[str]:
        return [
            f"- prompt: {self.prompt_tokens:,} tokens; local prefill {self.local_prefill_tps:g} tok/s (the proposal)",
            f"- remote prefill: {self.remote_prefill_tps:,.0f} tok/s averaged over the prompt (assumed: a 27B on one "
            "big GPU); the same GGUF and quant on both sides",
            f"- start-up: {self.startup_s:g} s (round trips to the remote server and its relay; assumed)",
            f"- slot save: {self.save_bytes_per_s / 1e6:,.0f} MB/s (measured here: 91.5 MB in 0.27 s); restore: "
            f"{self.restore_bytes_per_s / 1e6:,.0f} MB/s (assumed; 16 ms for 91.5 MB here from the page cache)",
            "- transfer: the link's nominal rate, no compression, save then transfer then restore (not overlapped)",
            "- KV bytes/token = layers × KV heads × head dim × 2 (K, V) × bytes/element (f16 2, q8_0 34/32, "
            "q4_0 18/32); formula checked on the 0.5B here: 12,288 B computed vs 12.3 kB measured",
        ]


@dataclass(frozen=True, slots=True)
class RemoteRow:
    arch: str
    cache_type: str
    link_gbit: float
    kv_bytes_per_token: float
    kv_gb: float
    local_s: float
    remote_prefill_s: float
    save_s: float
    transfer_s: float
    restore_s: float
    remote_s: float
    break_even_tokens: int | None  # shortest prompt for which the remote path is faster; None: never


def remote_row(a: Assumptions, arch: Architecture, cache_type: str, link_gbit: float, local_tps: float) -> RemoteRow:
    per_token = arch.kv_bytes_per_token(cache_type)
    size = per_token * a.prompt_tokens
    link = link_gbit * 1e9 / 8
    # The slot file's trip, priced by the proxy's own model of it (kv/costs.py), at this row's facts.
    wire = LinkCosts(1.0, bytes_per_token_prior=per_token, bandwidth_prior_bytes_per_s=link)
    save, transfer, restore = size / a.save_bytes_per_s, wire.transfer_s(a.prompt_tokens), size / a.restore_bytes_per_s
    remote_prefill = a.prompt_tokens / a.remote_prefill_tps
    # Per token, the remote path costs its prefill plus moving its bytes; the local path 1/local_tps.
    remote_per_token = (
        1 / a.remote_prefill_tps + per_token * (1 / a.save_bytes_per_s + 1 / a.restore_bytes_per_s) + wire.transfer_s(1)
    )
    gain = 1 / local_tps - remote_per_token
    return RemoteRow(
        arch=arch.name,
        cache_type=cache_type,
        link_gbit=link_gbit,
        kv_bytes_per_token=per_token,
        kv_gb=size / 1e9,
        local_s=a.prompt_tokens / local_tps,
        remote_prefill_s=remote_prefill,
        save_s=save,
        transfer_s=transfer,
        restore_s=restore,
        remote_s=a.startup_s + remote_prefill + save + transfer + restore,
        break_even_tokens=int(a.startup_s / gain) + 1 if gain > 0 else None,
    )


def _minutes(s: float) -> str:
    return f"{s:,.0f} s ({s / 60:.1f} min)" if s >= 120 else f"{s:,.1f} s"


def remote_tables(a: Assumptions | None = None) -> str:
    a = a or Assumptions()
    lines = [
        f"simulated: remote prefill of a {a.prompt_tokens:,}-token prompt (local {a.local_prefill_tps:g} tok/s) vs "
        f"the remote path",
        "",
        "| model KV | cache | link | KV/token | KV size | local prefill | remote prefill | save | transfer | restore "
        "| remote path | faster by | break-even prompt |",
        "|" + "---|" * 13,
    ]
    for arch in (ARCH_27B, ARCH_27B_GQA4):
        for cache_type in CACHE_TYPES:
            for link in a.links_gbit:
                r = remote_row(a, arch, cache_type, link, a.local_prefill_tps)
                even = f"{r.break_even_tokens:,} tok" if r.break_even_tokens is not None else "never"
                lines.append(
                    f"| {arch.kv_heads} KV heads | {cache_type} | {link:g} Gbit/s "
                    f"| {r.kv_bytes_per_token / 1024:,.0f} KiB "
                    f"| {r.kv_gb:.2f} GB | {_minutes(r.local_s)} | {r.remote_prefill_s:.1f} s | {r.save_s:.1f} s "
                    f"| {r.transfer_s:.1f} s | {r.restore_s:.1f} s | {_minutes(r.remote_s)} "
                    f"| {r.local_s / r.remote_s:,.0f}× | {even} |"
                )
    lines += ["", "break-even prompt length by local prefill speed (8 KV heads; below it, prefill locally):", ""]
    speeds = (10.0, 100.0, 500.0, 1000.0, 2000.0)
    lines += ["| cache | link | " + " | ".join(f"local {s:g} tok/s" for s in speeds) + " |", "|" + "---|" * 7]
    for cache_type in CACHE_TYPES:
        for link in a.links_gbit:
            cells = []
            for s in speeds:
                tokens = remote_row(a, ARCH_27B, cache_type, link, s).break_even_tokens
                cells.append(f"{tokens:,}" if tokens is not None else "never")
            lines.append(f"| {cache_type} | {link:g} Gbit/s | " + " | ".join(cells) + " |")
    return "\n".join([*lines, "", "assumptions:", *a.lines()])
