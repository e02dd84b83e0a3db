"""What a setup of llama-servers will hold in memory, said before it is launched: each server's model file, drafter file
and KV cache at the context asked for (from the GGUF's own dimensions), and, given a device report, whether it fits and
what would.

Pure: the GGUF is read and the device asked elsewhere.

On a GPU every llama-server process holds its own copy of the weights (CUDA does not share a mapped file between
processes), so a second profile process doubles them; on a CPU the mapped file's pages are shared."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MIB = 1024 * 1024
# Bytes per cached element by --cache-type-k/-v (llama.cpp's block sizes: q8_0 is 34 bytes per 32, q4_0 18 per 32).
KV_TYPE_BYTES = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q5_1": 24 / 32,
    "q5_0": 22 / 32,
    "q4_1": 20 / 32,
}
KV_TYPE_BYTES["q4_0"] = 18 / 32
# llama.cpp's own --fit-target default: what it leaves free on each device.
DEFAULT_MARGIN_MIB = 1024
N_UBATCH = 512  # llama-server's default -ub: the batch a sliding-window cache keeps room for beside its window
N_CTX_CHECKPOINTS = 32  # llama-server's default --ctx-checkpoints: context checkpoints kept per slot


@dataclass(frozen=True, slots=True)
class ModelDims:
    """What sizes a model's cache: from its GGUF metadata."""

    name: str
    file_bytes: int
    kv_layers: int  # layers with an attention KV cache (a hybrid's recurrent layers have none)
    kv_heads: int
    key_length: int
    value_length: int
    recurrent_layers: int = 0
    recurrent_state_elems: int = 0  # f32 elements of one recurrent layer's state, per sequence
    max_context: int = 0  # the model's trained context (0: unknown)
    # Of the kv_layers, those with sliding-window attention (Gemma: 5 of every 6) and their window in tokens: their
    # cache holds the window and a batch per sequence, not the context (llama.cpp's `llama_kv_cache_iswa`).
    swa_layers: int = 0
    swa_window: int = 0
    nextn_layers: int = 0  # next-token prediction (MTP) layers after the trunk: the target's own draft head

    def mtp_head(self) -> ModelDims:
        """The MTP head as `--spec-type draft-mtp` runs it: a draft context over the same file, with a KV cache of its
        own for its layers at the server's context."""
        return ModelDims(
            f"{self.name} MTP head", 0, self.nextn_layers, self.kv_heads, self.key_length, self.value_length
        )

    def kv_bytes_per_token(self, kv_type: str = "f16") -> float:
        """Every attention layer's bytes per cached token (a slot file's KV per token, the window's layers included)."""
        per_elem = KV_TYPE_BYTES.get(kv_type, 2.0)
        return self.kv_layers * self.kv_heads * (self.key_length + self.value_length) * per_elem

    def full_kv_bytes_per_token(self, kv_type: str = "f16") -> float:
        """The bytes per token of the layers whose cache spans the whole context (all of them without SWA)."""
        return self.kv_bytes_per_token(kv_type) * (self.kv_layers - self.swa_layers) / max(1, self.kv_layers)

    def swa_cells(self, ctx_size: int, slots: int, n_ubatch: int = N_UBATCH) -> int:
        """The cells llama.cpp gives the sliding-window layers, over all slots (one stream each): the window and a
        batch per slot, padded to 256, at most the slot's context (`llama_kv_cache_iswa`, b11549)."""
        if not self.swa_layers:
            return 0
        per_slot = min(ctx_size // max(1, slots), self.swa_window + n_ubatch)
        return -(-per_slot // 256) * 256 * max(1, slots)

    def checkpoint_bytes(self, ctx_size: int, slots: int, kv_type: str = "f16") -> int:
        """What one context checkpoint of a slot holds at most (llama-server keeps up to 32 per slot, in RAM, and
        b11549 writes them into slot files): the recurrent state, and the sliding-window layers' cache."""
        swa_per_token = self.kv_bytes_per_token(kv_type) - self.full_kv_bytes_per_token(kv_type)
        swa = swa_per_token * self.swa_cells(ctx_size, slots) / max(1, slots)
        return round(self.recurrent_bytes_per_slot() + swa)

    def recurrent_bytes_per_slot(self) -> int:
        return self.recurrent_layers * self.recurrent_state_elems * 4


@dataclass(frozen=True, slots=True)
class ServerToLaunch:
    """One llama-server as it will be launched: its models and cache."""

    name: str
    model: ModelDims
    ctx_size: int  # -c: the KV cache's tokens, shared by the slots (each slot gets ctx_size / slots)
    slots: int = 1
    drafter: ModelDims | None = None  # a separate draft GGUF (-md), with a cache of its own at the same context
    kv_type: str = "f16"
    # Copies of a recurrent target's state kept per slot so a rejected draft can be rolled back (llama.cpp's
    # n_rs_seq: the draft's n_max where a model drafts for a recurrent target; 0 otherwise).
    rollback_states: int = 0


@dataclass(frozen=True, slots=True)
class Footprint:
    name: str
    model_bytes: int
    drafter_bytes: int
    kv_bytes: int
    recurrent_bytes: int
    kv_bytes_per_token: float
    # One context checkpoint of every slot (recurrent state, sliding-window cache): llama-server keeps up to
    # N_CTX_CHECKPOINTS per slot in RAM, beside the device's memory; 0 for a dense model (it makes none).
    checkpoint_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.model_bytes + self.drafter_bytes + self.kv_bytes + self.recurrent_bytes


def footprint(server: ServerToLaunch) -> Footprint:
    """`kv_bytes_per_token`: what each token of context adds (the sliding-window layers' fixed cache is in
    `kv_bytes`, not in it)."""
    per_token, kv, recurrent, drafter_bytes, checkpoint = 0.0, 0.0, 0, 0, 0
    for dims in (server.model, server.drafter):
        if dims is None:
            continue
        full = dims.full_kv_bytes_per_token(server.kv_type)
        window = dims.kv_bytes_per_token(server.kv_type) - full
        per_token += full
        kv += full * server.ctx_size + window * dims.swa_cells(server.ctx_size, server.slots)
        rollback = server.rollback_states if dims is server.model else 0  # a drafter's context keeps none
        recurrent += dims.recurrent_bytes_per_slot() * server.slots * (1 + rollback)
        checkpoint += dims.checkpoint_bytes(server.ctx_size, server.slots, server.kv_type)
        drafter_bytes += dims.file_bytes if dims is server.drafter else 0
    return Footprint(
        server.name, server.model.file_bytes, drafter_bytes, round(kv), recurrent, per_token, checkpoint * server.slots
    )


@dataclass(frozen=True, slots=True)
class DeviceReport:
    """A GPU as its driver reports it (nvidia-smi), or as the user states it."""

    name: str
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True, slots=True)
class Verdict:
    fits: bool
    need_bytes: int
    free_bytes: int
    text: str


def _mib(n: float) -> str:
    return f"{n / MIB:,.0f} MiB"


def largest_context(servers: Sequence[ServerToLaunch], free_bytes: int, margin_bytes: int) -> int:
    """The largest -c every server could be given (the same for each) and still fit in `free_bytes`; 0 if none."""
    if not servers:
        return 0
    # What does not grow with -c: weights, recurrent state, a sliding window's cache.
    fixed = sum(footprint(p).total_bytes - round(footprint(p).kv_bytes_per_token * p.ctx_size) for p in servers)
    per_token = sum(footprint(p).kv_bytes_per_token for p in servers)
    room = free_bytes - margin_bytes - fixed
    if room <= 0 or per_token <= 0:
        return 0
    return int(room // per_token)


def verdict(servers: Sequence[ServerToLaunch], device: DeviceReport, margin_mib: int = DEFAULT_MARGIN_MIB) -> Verdict:
    """Whether these servers fit the device, and if not, what would: one server instead of several, a smaller context.
    llama-server does not fail when they do not: it offloads fewer layers to the GPU, which is slower."""
    margin = margin_mib * MIB
    need = sum(footprint(p).total_bytes for p in servers)
    if need + margin <= device.free_bytes:
        return Verdict(
            True, need, device.free_bytes, f"fits {device.name}: needs {_mib(need)} of {_mib(device.free_bytes)} free"
        )
    options = []
    if len(servers) > 1 and footprint(servers[0]).total_bytes + margin <= device.free_bytes:
        options.append("one server for every profile (a llama-server with per-request speculation)")
    ctx = largest_context(servers, device.free_bytes, margin)
    slots = servers[0].slots if servers else 1
    if ctx >= 512 * slots:
        options.append(f"-c {ctx // 256 * 256} (the largest context that fits, for every server)")
    text = (
        f"does not fit {device.name}: needs {_mib(need)} + {margin_mib} MiB margin, {_mib(device.free_bytes)} free; "
        "llama-server will offload fewer layers to the GPU (slower)"
    )
    if options:
        text += "; would fit: " + " or ".join(options)
    return Verdict(False, need, device.free_bytes, text)


def describe(servers: Sequence[ServerToLaunch], shared_file_pages: bool) -> list[str]:
    """One line per server and a total: what start-up prints before launching."""
    lines = []
    for p in servers:
        f = footprint(p)
        parts = [f"model {_mib(f.model_bytes)}"]
        if f.drafter_bytes:
            parts.append(f"drafter {_mib(f.drafter_bytes)}")
        window = f.kv_bytes - round(f.kv_bytes_per_token * p.ctx_size)
        windowed = f" + {p.model.swa_window}-token windows {_mib(window)}" if p.model.swa_layers and window else ""
        parts.append(
            f"KV {_mib(f.kv_bytes)} ({p.ctx_size} tokens × {f.kv_bytes_per_token / 1024:.1f} KiB{windowed}, {p.kv_type}"
            + (f", {p.slots} slots of {p.ctx_size // p.slots}" if p.slots > 1 else "")
            + ")"
        )
        if f.recurrent_bytes:
            rollback = f" with {p.rollback_states} rollback copies a slot" if p.rollback_states else ""
            parts.append(f"recurrent state {_mib(f.recurrent_bytes)}{rollback}")
        line = f"  {p.name}: " + ", ".join(parts) + f" = {_mib(f.total_bytes)}"
        if f.checkpoint_bytes:
            line += (
                f"; context checkpoints up to {N_CTX_CHECKPOINTS} × {_mib(f.checkpoint_bytes)} "
                f"= {_mib(N_CTX_CHECKPOINTS * f.checkpoint_bytes)} in RAM"
            )
        lines.append(line)
    total = sum(footprint(p).total_bytes for p in servers)
    note = ""
    if len(servers) > 1 and shared_file_pages:
        shared = sum(footprint(p).model_bytes + footprint(p).drafter_bytes for p in servers[1:])
        note = f" (on this CPU the model files' pages are shared between processes: {_mib(total - shared)} resident)"
    lines.append(f"  total for {len(servers)} server{'s' if len(servers) > 1 else ''}: {_mib(total)}{note}")
    return lines
