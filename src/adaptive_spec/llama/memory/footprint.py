"""The memory a launch will hold, said before it is spent: the GGUFs' dimensions read here, the GPU asked through
`nvidia-smi` (or stated by the user), the sums and the verdict from `llama/memory/sizing.py`."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

from adaptive_spec.errors import ModelError
from adaptive_spec.llama.memory.gguf_info import model_dims
from adaptive_spec.llama.memory.sizing import MIB, DeviceReport, ModelDims, ServerToLaunch, describe, verdict
from adaptive_spec.llama.profiles import ProfileSpec, ServerSettings

Query = Callable[[], str | None]
# The speculation types whose drafts a recurrent target verifies with rollback copies of its state, one per draft
# token (llama.cpp's `need_n_rs_seq`), and the draft length llama.cpp takes when none is given (draft-mtp: no -md).
_ROLLBACK_TYPES = frozenset({"draft-mtp", "draft-eagle3", "draft-dflash", "draft-dspark"})
_LLAMA_DRAFT_N_MAX = 3


def nvidia_smi() -> str | None:
    """`nvidia-smi`'s name, total and free memory (MiB) of the first GPU, or None where there is none."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return None
    try:
        done = subprocess.run(
            [binary, "--query-gpu=name,memory.total,memory.free", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.splitlines()[0] if done.stdout.strip() else None


def device_report(stated_mib: int | None = None, query: Query = nvidia_smi) -> DeviceReport | None:
    """The device to fit: one the user states (`--device-memory MIB`), else the first NVIDIA GPU, else None."""
    if stated_mib is not None:
        return DeviceReport(f"a {stated_mib:,} MiB device (--device-memory)", stated_mib * MIB, stated_mib * MIB)
    line = query()
    if line is None:
        return None
    try:
        name, total, free = (part.strip() for part in line.split(","))
        return DeviceReport(name, int(float(total)) * MIB, int(float(free)) * MIB)
    except ValueError:
        return None


def cache_type_k(extra_args: Sequence[str]) -> str:
    """The K cache type a server is launched with (`-ctk`), f16 when not named."""
    args = list(extra_args)
    for flag in ("-ctk", "--cache-type-k"):
        if flag in args[:-1]:
            return args[args.index(flag) + 1]
    return "f16"


def servers_to_launch(specs: Sequence[ProfileSpec], settings: ServerSettings) -> list[ServerToLaunch] | None:
    """Each server to launch as `llama/memory/sizing.py` sizes it; None when a model is not a local file (`hf:`:
    llama-server downloads it) or its header cannot be read."""
    if settings.model.path is None:
        return None
    try:
        model = model_dims(Path(settings.model.path))
        drafter = model_dims(Path(settings.draft.path)) if settings.draft and settings.draft.path else None
    except ModelError:
        return None
    kv_type = cache_type_k(settings.extra_args)
    return [
        ServerToLaunch(
            spec.name,
            model,
            settings.ctx_size,
            slots=settings.parallel,
            drafter=drafter if spec.uses_draft_file else (model.mtp_head() if _uses_mtp(spec, model) else None),
            kv_type=kv_type,
            rollback_states=rollback_states(spec, settings),
        )
        for spec in specs
    ]


def _uses_mtp(spec: ProfileSpec, model: ModelDims) -> bool:
    return "draft-mtp" in spec.spec_types and model.nextn_layers > 0


def rollback_states(spec: ProfileSpec, settings: ServerSettings) -> int:
    """The rollback copies of a recurrent state a profile's server keeps per slot: the draft's n_max where a model
    drafts (`--spec-draft-n-max` with a draft file, llama.cpp's default for the target's own MTP head), else 0."""
    if not _ROLLBACK_TYPES.intersection(spec.spec_types):
        return 0
    return settings.draft_n_max if spec.uses_draft_file else _LLAMA_DRAFT_N_MAX


def launch_lines(
    specs: Sequence[ProfileSpec], settings: ServerSettings, device: DeviceReport | None, design: str
) -> list[str]:
    """`memory:` and a line per server, the total, and the verdict where there is a device to fit."""
    servers = servers_to_launch(specs, settings)
    if servers is None:
        return ["memory: not estimated (the model is not a local GGUF here)"]
    lines = [f"memory ({design}; weights and KV cache, before compute buffers):"]
    lines += describe(servers, shared_file_pages=device is None)
    if device is not None:
        lines.append("  " + verdict(servers, device).text)
    return lines
