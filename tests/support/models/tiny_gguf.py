"""Writes a tiny random-weight llama GGUF: loads in a blink and decodes thousands of tokens a second.

For plumbing tests against a REAL llama-server (its output is noise, but deterministic per server).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# A trained context as large as the tests' slots: llama-server b11549 caps a slot's context at it.
N_EMBD, N_HEAD, N_LAYER, N_FF, N_CTX = 64, 4, 2, 128, 32768


def _vocab() -> tuple[list[str], list[int]]:
    T = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    types = [T.UNKNOWN, T.CONTROL, T.CONTROL, T.CONTROL, T.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [T.BYTE] * 256
    for code in range(32, 127):
        tokens.append("\u2581" if code == 32 else chr(code))
        types.append(T.NORMAL)
    for word in ("\u2581the", "\u2581def", "\u2581return", "\u2581a", "in", "er", "\u2581x"):
        tokens.append(word)
        types.append(T.NORMAL)
    return tokens, [int(t) for t in types]


def add_tiny_tokenizer(writer: gguf.GGUFWriter) -> int:
    """The byte + ASCII vocabulary and ChatML template; drafters carry the same one (llama-server compares them).
    Returns the vocabulary size."""
    tokens, types = _vocab()
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([float(-i) for i in range(len(tokens))])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(4)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    return len(tokens)


def write_tiny_gguf(path: Path, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-random-llama")
    writer.add_context_length(N_CTX)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    n_vocab = add_tiny_tokenizer(writer)

    def tensor(name: str, *shape: int, scale: float = 0.5) -> None:
        # float32 explicitly: numpy 2 would promote to float64, which llama-server cannot load.
        writer.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    def ones(name: str, n: int) -> None:
        writer.add_tensor(name, np.ones(n, dtype=np.float32))

    tensor("token_embd.weight", n_vocab, N_EMBD)
    for i in range(N_LAYER):
        ones(f"blk.{i}.attn_norm.weight", N_EMBD)
        for part in ("q", "k", "v", "output"):
            tensor(f"blk.{i}.attn_{part}.weight", N_EMBD, N_EMBD, scale=0.1)
        ones(f"blk.{i}.ffn_norm.weight", N_EMBD)
        tensor(f"blk.{i}.ffn_gate.weight", N_FF, N_EMBD, scale=0.1)
        tensor(f"blk.{i}.ffn_up.weight", N_FF, N_EMBD, scale=0.1)
        tensor(f"blk.{i}.ffn_down.weight", N_EMBD, N_FF, scale=0.1)
    ones("output_norm.weight", N_EMBD)
    tensor("output.weight", n_vocab, N_EMBD)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
