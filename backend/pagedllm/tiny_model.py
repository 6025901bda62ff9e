"""`pagedllm make-tiny-model`: a complete HF-style model directory made offline.

Seeded random weights (scaled so logits are peaked: greedy decoding is then stable against rounding, which
token-identical tests against transformers need), and a byte-level BPE tokenizer trained on local text (the
Python standard library's sources), so no model hub is ever needed.
"""

from __future__ import annotations

import glob
import math
import os
import sysconfig

import torch

SIZES = {
    # name: hidden, intermediate, layers, heads, kv heads, tokenizer vocab
    "tiny": (128, 256, 2, 4, 2, 2048),
    "small": (256, 688, 4, 4, 2, 32000),
    "125m": (768, 2048, 12, 12, 4, 32000),
    "1b": (2048, 5632, 16, 32, 8, 32000),
    # Qwen2.5-0.5B's layer shapes (2 KV heads of 64) with our offline tokenizer's 32k vocabulary: 0.39B params
    "0.5b": (896, 4864, 24, 14, 2, 32000),
}
ARCHS = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "mixtral", "qwen3_moe", "qwen2_moe",
         "gpt_neox", "stablelm", "gemma2")
SPECIALS = ["<s>", "</s>", "<pad>"]


def training_corpus(max_bytes: int) -> list[str]:
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "**", "*.py"), recursive=True))
    texts, total = [], 0
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        texts.append(text)
        total += len(text)
        if total >= max_bytes:
            break
    # A little non-ASCII text so multi-byte characters get tokens of their own (and split ones).
    texts.append("naïve café déjà vu — 東京 北京 Ωμέγα ∑∫√ 😀🚀 " * 50)
    return texts


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_corpus(max_bytes=vocab_size * 600), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   clean_up_tokenization_spaces=False)


def hf_config(arch: str, size: str, vocab_size: int, num_key_value_heads: int | None = None):
    from transformers import (Gemma3TextConfig, LlamaConfig, MistralConfig, MixtralConfig, Phi3Config, Qwen2Config,
                              Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)

    hidden, inter, layers, heads, kv, _ = SIZES[size]
    kv = num_key_value_heads or kv
    common = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=2048,
                  bos_token_id=0, eos_token_id=1, pad_token_id=2, rms_norm_eps=1e-6)
    if arch == "llama":
        # Llama-3-style rope scaling, so the scaled path is exercised.
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
        return LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=False)
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=None, tie_word_embeddings=False)
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=hidden // heads, tie_word_embeddings=True)
    if arch == "phi3":
        return Phi3Config(**common, tie_word_embeddings=False, sliding_window=None)
    # Mixtures of experts: 8 experts, 2 per token, so that routing decides the output.
    if arch == "mixtral":
        return MixtralConfig(**common, num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)
    if arch == "qwen3_moe":  # the last layer dense (mlp_only_layers)
        return Qwen3MoeConfig(**common, head_dim=hidden // heads, num_experts=8, num_experts_per_tok=2,
                              moe_intermediate_size=inter // 4, norm_topk_prob=True, mlp_only_layers=[layers - 1],
                              tie_word_embeddings=False)
    if arch == "qwen2_moe":  # with the shared expert; top-k weights not renormalised
        return Qwen2MoeConfig(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=inter // 4,
                              shared_expert_intermediate_size=inter // 2, norm_topk_prob=False,
                              tie_word_embeddings=False)
    # Architectures the registry does not know (they run through the transformers fallback).
    if arch == "gpt_neox":  # multi-head attention, partial rotary, parallel residual, LayerNorm
        from transformers import GPTNeoXConfig

        return GPTNeoXConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=inter,
                             num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=2048,
                             bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)
    if arch == "stablelm":  # GQA, partial rotary, qkv bias, LayerNorm
        from transformers import StableLmConfig

        return StableLmConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=inter,
                              num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                              max_position_embeddings=2048, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                              use_qkv_bias=True, tie_word_embeddings=False)
    if arch == "gemma2":  # soft-capped attention scores and logits, one sliding-window layer (24) and one global
        from transformers import Gemma2Config

        return Gemma2Config(**common, head_dim=hidden // heads, query_pre_attn_scalar=hidden // heads,
                            sliding_window=24, layer_types=["sliding_attention", "full_attention"][:layers] +
                            ["full_attention"] * max(0, layers - 2), attn_logit_softcapping=3.0,
                            final_logit_softcapping=5.0, tie_word_embeddings=False)
    if arch == "gemma3":  # one sliding-window layer (window 24, local rope) and one global one
        rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}}
        return Gemma3TextConfig(**common, head_dim=hidden // heads, query_pre_attn_scalar=hidden // heads,
                                sliding_window=24, layer_types=["sliding_attention", "full_attention"][:layers] +
                                ["full_attention"] * max(0, layers - 2), rope_parameters=rope,
                                tie_word_embeddings=False, architectures=["Gemma3ForCausalLM"])
    raise ValueError(f"--arch: expected one of {', '.join(ARCHS)}, got {arch!r}")


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Variance-preserving projections and unit-scale embeddings: the output distribution is peaked."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.dim() == 1:  # biases
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            elif "lm_head" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * (3.0 / math.sqrt(p.shape[1])))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))


def make_tiny_model(out_dir: str, arch: str = "llama", size: str = "tiny", seed: int = 0,
                    dtype: str = "float32", max_shard_size: str | None = None,
                    num_key_value_heads: int | None = None) -> str:
    if size not in SIZES:
        raise ValueError(f"--size: expected one of {', '.join(SIZES)}, got {size!r}")
    tokenizer = build_tokenizer(SIZES[size][5])
    config = hf_config(arch, size, len(tokenizer), num_key_value_heads)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    return save_random_model(out_dir, config, tokenizer, seed, dtype, **kwargs)


def make_variant_model(out_dir: str, arch: str = "llama", seed: int = 0, bin_weights: bool = False,
                       **config_changes) -> str:
    """A tiny model of `arch` with config fields changed (mlp_bias, head_dim, sliding_window, ...), built by
    transformers from that config; `bin_weights`: saved as pytorch_model.bin instead of safetensors."""
    tokenizer = build_tokenizer(SIZES["tiny"][5])
    config = hf_config(arch, "tiny", len(tokenizer))
    for key, value in config_changes.items():
        setattr(config, key, value)
    if "sliding_window" in config_changes or "max_window_layers" in config_changes:  # derived in __init__
        config = type(config)(**{k: v for k, v in config.to_dict().items() if k != "layer_types"})
    save_random_model(out_dir, config, tokenizer, seed, "float32")
    if bin_weights:  # transformers 5 saves safetensors only: rewrite the weights as a PyTorch pickle
        from safetensors.torch import load_file

        weights = os.path.join(out_dir, "model.safetensors")
        torch.save(load_file(weights), os.path.join(out_dir, "pytorch_model.bin"))
        os.remove(weights)
    return out_dir


def save_random_model(out_dir: str, config, tokenizer, seed: int = 0, dtype: str = "float32", **save_kwargs) -> str:
    """transformers' model for `config` with init_weights' random weights, saved with the tokenizer."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    init_weights(model, seed)
    if config.model_type.startswith("gemma"):  # Gemma's norms scale by 1 + weight: 0 is their identity
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.zero_()
    model.to(getattr(torch, dtype))
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, **save_kwargs)
    GenerationConfig(bos_token_id=0, eos_token_id=1, pad_token_id=2).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def first_layers_model(src_dir: str, out_dir: str, layers: int) -> str:
    """Copy of a single-file checkpoint keeping only its first `layers` decoder layers (same tokenizer,
    embeddings and head): a draft model for speculative decoding whose guesses resemble the target's."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src_dir, out_dir, dirs_exist_ok=True)
    with open(os.path.join(out_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = layers
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    weights = load_file(os.path.join(out_dir, "model.safetensors"))
    keep = {k: v for k, v in weights.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(keep, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_lora_adapter(model_dir: str, out_dir: str, rank: int = 8, seed: int = 0,
                      targets: tuple[str, ...] = LORA_TARGETS, alpha: float | None = None,
                      use_rslora: bool = False, scale: float = 1.0, **lora_config) -> str:
    """A PEFT LoRA adapter with random A and B for the model at `model_dir`, saved by PEFT itself
    (adapter_config.json + adapter_model.safetensors). `scale` multiplies B (how far the adapter moves the
    model); `lora_config`: more LoraConfig fields (alpha_pattern, rank_pattern, ...). Needs the `peft` package
    (a test dependency)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, target_modules=list(targets),
                        init_lora_weights=False, use_rslora=use_rslora, **lora_config)
    model = get_peft_model(base, config)
    if scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name or "lora_embedding_B" in name:
                    p.mul_(scale)
    model.save_pretrained(out_dir)
    return out_dir
