"""Tiny random-weight drafters that llama-server (llama.cpp b11434) loads and runs beside the tiny target model.

Each layout is read off the llama.cpp source of the build in use: the architecture and tensor names in
src/llama-arch.cpp, the hyper-parameters and tensors each loader asks for in src/models/<arch>.cpp
(`load_arch_hparams`, `load_arch_tensors`), and what the speculative driver needs of the pair in
common/speculative.cpp. Their drafts are noise: they prove the plumbing (a drafter loads, drafts, is verified and
counted), never a speed or an acceptance rate.

- DFlash (`--spec-type draft-dflash`), src/models/dflash.cpp: a block-diffusion drafter that reads hidden states of
  the target's layers `dflash.target_layers` (fused by `fc` + `enc.output_norm`), denoises a block of
  `dflash.block_size` positions `[last, <mask>...]` with non-causal attention and projects them through the
  target's own embeddings and LM head (a draft without `token_embd`/`output` shares the target's).
- EAGLE3 (`draft-eagle3`), src/models/eagle3.cpp: one decoder layer over the target's token embedding and three of
  its layers' hidden states (`eagle3.target_layers`, exactly three; `eagle3.target_hidden_size`).
- MTP (`draft-mtp`) drafts with the target's own next-token heads, so its tiny model is a *target*: a Qwen3.5-style
  `qwen35` model (src/models/qwen35.cpp, the architecture of the Qwen3.6 models the public benchmark ran) with one
  gated-delta-net layer, one gated full-attention layer and one MTP block after them (`nextn_predict_layers = 1`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

from tests.support.models.tiny_gguf import N_CTX, N_EMBD, N_FF, N_HEAD, N_LAYER, add_tiny_tokenizer

HEAD_DIM = N_EMBD // N_HEAD
DFLASH_BLOCK = 16  # drafts at most 15 tokens: the launched profiles' --spec-draft-n-max
DFLASH_TARGET_LAYERS = (0, 1)
# EAGLE3 takes exactly three target layers (low, middle, high); the tiny target has two, so one is read twice.
EAGLE3_TARGET_LAYERS = (0, 1, 1)
MASK_TOKEN_ID = 0  # <unk>: DFlash fills the block with this token; it must exist in the target's vocabulary


class _Weights:
    """Writes float32 tensors (numpy 2 would promote to float64, which llama-server cannot load)."""

    def __init__(self, writer: gguf.GGUFWriter, seed: int) -> None:
        self._writer = writer
        self._rng = np.random.default_rng(seed)

    def random(self, name: str, *shape: int, scale: float = 0.1) -> None:
        self._writer.add_tensor(name, (self._rng.standard_normal(shape) * scale).astype(np.float32))

    def ones(self, name: str, n: int) -> None:
        self._writer.add_tensor(name, np.ones(n, dtype=np.float32))

    def filled(self, name: str, n: int, value: float) -> None:
        self._writer.add_tensor(name, np.full(n, value, dtype=np.float32))


Body = Callable[[gguf.GGUFWriter, _Weights, int], None]  # writer, weights, vocabulary size


def _write(path: Path, arch: str, name: str, seed: int, body: Body) -> Path:
    # Shapes below are numpy's (rows, columns): the reverse of the {ne0, ne1} the loaders list.
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_context_length(N_CTX)
    writer.add_embedding_length(N_EMBD)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    n_vocab = add_tiny_tokenizer(writer)
    body(writer, _Weights(writer, seed), n_vocab)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _ffn(w: _Weights, i: int) -> None:
    w.ones(f"blk.{i}.ffn_norm.weight", N_EMBD)
    w.random(f"blk.{i}.ffn_gate.weight", N_FF, N_EMBD)
    w.random(f"blk.{i}.ffn_up.weight", N_FF, N_EMBD)
    w.random(f"blk.{i}.ffn_down.weight", N_EMBD, N_FF)


def write_tiny_dflash(path: Path, seed: int = 1) -> Path:
    """A one-layer DFlash drafter for the tiny target (same hidden size: it borrows the target's embeddings)."""

    def body(writer: gguf.GGUFWriter, w: _Weights, n_vocab: int) -> None:
        writer.add_block_count(1)
        writer.add_feed_forward_length(N_FF)
        writer.add_array("dflash.target_layers", list(DFLASH_TARGET_LAYERS))
        writer.add_uint32("dflash.block_size", DFLASH_BLOCK)
        writer.add_uint32("tokenizer.ggml.mask_token_id", MASK_TOKEN_ID)
        w.random("fc.weight", N_EMBD, len(DFLASH_TARGET_LAYERS) * N_EMBD)
        w.ones("enc.output_norm.weight", N_EMBD)
        w.ones("output_norm.weight", N_EMBD)
        w.ones("blk.0.attn_norm.weight", N_EMBD)
        for part in ("q", "k", "v", "output"):
            w.random(f"blk.0.attn_{part}.weight", N_EMBD, N_EMBD)
        w.ones("blk.0.attn_q_norm.weight", HEAD_DIM)
        w.ones("blk.0.attn_k_norm.weight", HEAD_DIM)
        _ffn(w, 0)

    return _write(path, "dflash", "tiny-random-dflash", seed, body)


def write_tiny_eagle3(path: Path, seed: int = 2) -> Path:
    """A one-layer EAGLE3 drafter for the tiny target (its attention reads [embedding; fused features])."""

    def body(writer: gguf.GGUFWriter, w: _Weights, n_vocab: int) -> None:
        writer.add_block_count(1)
        writer.add_feed_forward_length(N_FF)
        writer.add_array("eagle3.target_layers", list(EAGLE3_TARGET_LAYERS))
        writer.add_uint32("eagle3.target_hidden_size", N_EMBD)
        w.random("fc.weight", N_EMBD, len(EAGLE3_TARGET_LAYERS) * N_EMBD)
        w.ones("output_norm.weight", N_EMBD)
        w.ones("blk.0.attn_norm.weight", N_EMBD)
        w.ones("blk.0.attn_norm_2.weight", N_EMBD)
        for part in ("q", "k", "v"):
            w.random(f"blk.0.attn_{part}.weight", N_EMBD, 2 * N_EMBD)
        w.random("blk.0.attn_output.weight", N_EMBD, N_EMBD)
        _ffn(w, 0)

    return _write(path, "eagle3", "tiny-random-eagle3", seed, body)


# The qwen35 gated delta net's sizes (src/models/qwen35.cpp, load_block_trunk): key/value heads of SSM_STATE each.
SSM_STATE, SSM_GROUPS, SSM_V_HEADS, SSM_CONV = 16, 2, 4, 4


def write_tiny_mtp_target(path: Path, seed: int = 3) -> Path:
    """A tiny `qwen35` target with an MTP block: layer 0 recurrent, layer 1 full attention, layer 2 the MTP head."""
    n_trunk = N_LAYER
    key_dim, value_dim = SSM_STATE * SSM_GROUPS, SSM_STATE * SSM_V_HEADS

    def attention(w: _Weights, i: int) -> None:
        w.random(f"blk.{i}.attn_q.weight", 2 * N_EMBD, N_EMBD)  # query and its output gate
        w.random(f"blk.{i}.attn_k.weight", N_EMBD, N_EMBD)
        w.random(f"blk.{i}.attn_v.weight", N_EMBD, N_EMBD)
        w.random(f"blk.{i}.attn_output.weight", N_EMBD, N_EMBD)
        w.ones(f"blk.{i}.attn_q_norm.weight", HEAD_DIM)
        w.ones(f"blk.{i}.attn_k_norm.weight", HEAD_DIM)

    def body(writer: gguf.GGUFWriter, w: _Weights, n_vocab: int) -> None:
        writer.add_block_count(n_trunk + 1)
        writer.add_uint32("qwen35.nextn_predict_layers", 1)
        writer.add_feed_forward_length(N_FF)
        writer.add_rope_dimension_count(HEAD_DIM)
        writer.add_array("qwen35.rope.dimension_sections", [HEAD_DIM // 4, HEAD_DIM // 8, HEAD_DIM // 8, 0])
        writer.add_uint32("qwen35.full_attention_interval", 2)
        writer.add_uint32("qwen35.ssm.conv_kernel", SSM_CONV)
        writer.add_uint32("qwen35.ssm.inner_size", value_dim)
        writer.add_uint32("qwen35.ssm.state_size", SSM_STATE)
        writer.add_uint32("qwen35.ssm.time_step_rank", SSM_V_HEADS)
        writer.add_uint32("qwen35.ssm.group_count", SSM_GROUPS)
        w.random("token_embd.weight", n_vocab, N_EMBD, scale=0.5)
        w.ones("output_norm.weight", N_EMBD)
        w.random("output.weight", n_vocab, N_EMBD, scale=0.5)
        for i in range(n_trunk + 1):
            w.ones(f"blk.{i}.attn_norm.weight", N_EMBD)
            w.ones(f"blk.{i}.post_attention_norm.weight", N_EMBD)
            w.random(f"blk.{i}.ffn_gate.weight", N_FF, N_EMBD)
            w.random(f"blk.{i}.ffn_up.weight", N_FF, N_EMBD)
            w.random(f"blk.{i}.ffn_down.weight", N_EMBD, N_FF)
            if i % 2 == 0 and i < n_trunk:  # gated delta net (linear attention)
                w.random(f"blk.{i}.attn_qkv.weight", 2 * key_dim + value_dim, N_EMBD)
                w.random(f"blk.{i}.attn_gate.weight", value_dim, N_EMBD)
                w.random(f"blk.{i}.ssm_conv1d.weight", 2 * key_dim + value_dim, SSM_CONV)
                w.filled(f"blk.{i}.ssm_dt.bias", SSM_V_HEADS, 0.0)
                w.filled(f"blk.{i}.ssm_a", SSM_V_HEADS, -1.0)
                w.random(f"blk.{i}.ssm_beta.weight", SSM_V_HEADS, N_EMBD)
                w.random(f"blk.{i}.ssm_alpha.weight", SSM_V_HEADS, N_EMBD)
                w.ones(f"blk.{i}.ssm_norm.weight", SSM_STATE)
                w.random(f"blk.{i}.ssm_out.weight", N_EMBD, value_dim)
            else:
                attention(w, i)
        mtp = n_trunk
        w.random(f"blk.{mtp}.nextn.eh_proj.weight", N_EMBD, 2 * N_EMBD)
        w.ones(f"blk.{mtp}.nextn.enorm.weight", N_EMBD)
        w.ones(f"blk.{mtp}.nextn.hnorm.weight", N_EMBD)

    return _write(path, "qwen35", "tiny-random-qwen35-mtp", seed, body)
