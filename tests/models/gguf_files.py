"""Writes small .gguf checkpoints the way llama.cpp's converter does, for the GGUF tests: a tiny HF Llama's
weights (Q and K rows permuted as the converter permutes them), its byte-level BPE tokenizer and a chat
template in the metadata, each tensor stored in a chosen GGML type.

Types the `gguf` package can quantize (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) are quantized from the
float weights. The K-quants (Q4_K, Q5_K, Q6_K) it can only dequantize, so their blocks are random bytes laid
out per llama.cpp's block structs, with the f16 scale fields set to small finite values: any such block is a
valid tensor, and the oracle (transformers) dequantizes the same bytes.
"""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# byte offsets of each K-quant block's f16 scale fields (ggml-common.h: block_q4_K, block_q5_K, block_q6_K)
_K_SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def permute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's LlamaModel.permute, written from its definition: each head's rows
    [first half | second half] become interleaved pairs."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode_tensor(weights: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:
    """The stored form of a (rows, cols) float32 tensor in GGML type `kind`."""
    if kind == "F32":
        return weights.astype(np.float32)
    if kind == "F16":
        return weights.astype(np.float16)
    if kind in _K_SCALE_OFFSETS:
        return random_k_blocks(weights.shape, kind, rng)
    return gguf.quants.quantize(weights.astype(np.float32), Q[kind])


def random_k_blocks(shape: tuple[int, int], kind: str, rng: np.random.Generator) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[Q[kind]]
    rows, cols = shape
    assert cols % block == 0, f"{kind} needs rows of a multiple of {block} values"
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for offset in _K_SCALE_OFFSETS[kind]:
        scales = rng.uniform(2e-4, 6e-4, size=raw.shape[0]).astype(np.float16)
        raw[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, cols // block * size)


def gguf_name(hf_name: str) -> str:
    from pagedllm.models.gguf_checkpoint import _GLOBAL_NAMES, _LAYER_NAMES

    for ours, theirs in _GLOBAL_NAMES.items():
        if hf_name == theirs:
            return ours
    parts = hf_name.split(".")  # model.layers.N.<module path>.<weight|bias>
    module = ".".join(parts[3:-1])
    short = {v: k for k, v in _LAYER_NAMES.items()}[module]
    return f"blk.{parts[2]}.{short}.{parts[-1]}"


def write_gguf(path: str, model_dir: str, kinds: dict[str, str] | None = None, default_kind: str = "F32",
               seed: int = 0, chat_template: str | None = CHATML) -> str:
    """The HF checkpoint (Llama, Qwen2 or Qwen3) in model_dir as a .gguf file; `kinds` maps a GGUF tensor-name
    fragment (e.g. "ffn_down", "token_embd") to its GGML type; 1-D tensors (norms, biases) stay F32, as
    llama.cpp keeps them. Only Llama's Q/K rows are permuted, as only its converter does that."""
    from safetensors.torch import load_file

    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    state = load_file(os.path.join(model_dir, "model.safetensors"))
    rng = np.random.default_rng(seed)
    arch = cfg["model_type"]
    w = gguf.GGUFWriter(path, arch)
    w.add_name("tiny-test-llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    _add_tokenizer(w, model_dir, chat_template)
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]} if arch == "llama" else {}
    for hf_name, tensor in state.items():
        if cfg.get("tie_word_embeddings") and hf_name == "lm_head.weight":
            continue
        name = gguf_name(hf_name)
        data = tensor.to(torch.float32).numpy()
        kind = "F32" if data.ndim == 1 else next((k for frag, k in (kinds or {}).items() if frag in name),
                                                   default_kind)
        short = name.split(".")[-2]
        if short in heads:
            data = permute_rows(data, heads[short])
        stored = encode_tensor(data, kind, rng)
        w.add_tensor(name, stored, raw_dtype=None if kind in ("F32", "F16") else Q[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_tokenizer(w, model_dir: str, chat_template: str | None) -> None:
    tok = json.load(open(os.path.join(model_dir, "tokenizer.json")))
    vocab = tok["model"]["vocab"]
    specials = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    tokens = [None] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        tokens[i] = text
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in specials else 1 for t in tokens])  # 3: control tokens
    w.add_token_merges(merges)
    w.add_bos_token_id(specials["<s>"])
    w.add_eos_token_id(specials["</s>"])
    w.add_pad_token_id(specials["<pad>"])
    w.add_add_bos_token(False)
    if chat_template:
        w.add_chat_template(chat_template)
