"""Variants inside the four families, and Phi-3, each against transformers on the same weights (fp32, greedy,
with and without preemption): `.bin` checkpoints, Llama's mlp_bias, Qwen3 with head_dim != hidden / heads,
Mistral's sliding window, Qwen2's use_sliding_window (a window on the layers from max_window_layers on), dynamic
NTK rope past its original context (each token's frequencies follow its rope length, as in transformers'
generate, across chunked prefill, preemption and the prefix cache), LongRoPE past it (a sequence is recomputed
once with the long factors at the crossing, as transformers' Phi-3 does), Phi-3's fused checkpoint projections with a
sliding window and partial rotary (Phi-4-mini's 0.75), Gemma 3 (its norms, sliding and global layers with their
own rope, final soft-capping), Gemma 2 (soft-capped attention scores and logits), the mixtures of experts
(Mixtral, Qwen3-MoE, Qwen2-MoE); mlp_bias, Phi-3, Gemma 3, Mixtral and Qwen2-MoE under tensor parallelism."""

import os

import pytest
import torch

from conftest import assert_all_blocks_free, random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.tiny_model import make_variant_model
from pagedllm_kernels.cpu.build import cpu_supported
from test_oracle import hf_greedy, ours

LENGTHS = [3, 30, 70, 120, 9]
MAX_TOKENS = [12, 40, 20, 16, 30]
VARIANTS = {
    "bin": dict(arch="llama", bin_weights=True),
    "mlp_bias": dict(arch="llama", mlp_bias=True),
    "qwen3_head_dim": dict(arch="qwen3", head_dim=48),
    "mistral_window": dict(arch="mistral", sliding_window=24),
    "qwen2_window": dict(arch="qwen2", use_sliding_window=True, sliding_window=24, max_window_layers=1),
    # dynamic: the longer prompts and outputs pass the original context (64), where the base grows per token
    "dynamic_rope": dict(arch="llama", max_position_embeddings=64, rope_parameters={
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0}),
    # LongRoPE: sequences passing the original context (64) switch to the long factors and are recomputed
    "phi3_longrope": dict(arch="phi3", original_max_position_embeddings=64, rope_parameters={
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
        "partial_rotary_factor": 1.0,
        "short_factor": [1.0 + 0.05 * i for i in range(16)], "long_factor": [2.0 + 0.3 * i for i in range(16)]}),
    "phi3": dict(arch="phi3"),
    "gemma3": dict(arch="gemma3"),
    "gemma2": dict(arch="gemma2"),
    "mixtral": dict(arch="mixtral"),
    "qwen3_moe": dict(arch="qwen3_moe"),
    "qwen2_moe": dict(arch="qwen2_moe"),
    "gemma3_softcap": dict(arch="gemma3", final_logit_softcapping=3.0),
    "phi3_window_partial_rotary": dict(arch="phi3", sliding_window=24,
                                       rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "partial_rotary_factor": 0.75}),
}


def block_bytes(model_dir: str) -> int:
    """One 16-token KV block of the model, fp32."""
    from transformers import AutoConfig

    from pagedllm.engine.kv_sizing import KVGeometry

    cfg = AutoConfig.from_pretrained(model_dir)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads  # GPT-NeoX: no GQA
    return KVGeometry(cfg.num_hidden_layers, kv_heads, head_dim).bytes_per_block(16, torch.float32)


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            made[name] = make_variant_model(str(tmp_path_factory.mktemp(name)), **VARIANTS[name])
        return made[name]

    return get


@pytest.mark.parametrize("preempt", [False, True], ids=["roomy", "preempting"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_matches_transformers(variant, name, preempt):
    d = variant(name)
    if name == "bin":
        assert os.path.exists(os.path.join(d, "pytorch_model.bin"))
        assert not os.path.exists(os.path.join(d, "model.safetensors"))
    prompts = random_prompts(LENGTHS, seed=len(name))
    if name == "dynamic_rope":  # transformers' dynamic rope remembers the longest length across calls
        expected = [hf_greedy(d, [p], [m])[0] for p, m in zip(prompts, MAX_TOKENS)]
    else:
        expected = hf_greedy(d, prompts, MAX_TOKENS)
    kwargs = dict(kv_cache_memory_bytes=20 * block_bytes(d), max_num_batched_tokens=96) if preempt else {}
    llm = LLM(d, dtype="float32", max_model_len=256, **{"kv_cache_memory_bytes": 16 << 20, **kwargs})
    assert ours(llm, prompts, MAX_TOKENS) == expected
    assert (llm.get_stats().num_preemptions > 0) == preempt
    assert_all_blocks_free(llm)


def test_longrope_recomputes_at_the_crossing_and_keeps_its_blocks_apart(variant):
    """A sequence that passes the original context is recomputed once with the long factors (transformers' Phi-3
    generate does the same); a long prompt's blocks never serve a short one's, nor the other way round."""
    d = variant("phi3_longrope")
    short, long_ = random_prompts([40], seed=10)[0], None
    long_ = short + random_prompts([40], seed=11)[0][1:]  # shares the short prompt's first blocks
    expected = [hf_greedy(d, [p], [m])[0] for p, m in ((short, 10), (long_, 10), (short, 40))]
    llm = LLM(d, dtype="float32", kv_cache_memory_bytes=8 << 20)
    got, cached = [], []
    for p, m in ((short, 10), (long_, 10), (short, 40)):
        out = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=m, ignore_eos=True),
                           use_tqdm=False)[0]
        got.append(out.outputs[0].token_ids)
        cached.append(out.num_cached_tokens)
    assert got == expected
    assert cached == [0, 0, 32]  # the long prompt reused nothing of the short one; the short one its own blocks


def test_dynamic_rope_prefix_cache_keys_long_prompts_by_length(variant):
    """A long prompt's tokens are rotated for its own length: another prompt sharing its first blocks but of a
    different length must not reuse them (and gets transformers' tokens); the same prompt again does."""
    d = variant("dynamic_rope")
    base = random_prompts([100], seed=9)[0]
    prompts = [base, base[:90], base]
    # one transformers model per prompt: its dynamic rope keeps the longest length it has seen across calls
    expected = [hf_greedy(d, [p], [10])[0] for p in prompts]
    llm = LLM(d, dtype="float32", kv_cache_memory_bytes=8 << 20)
    cached = []
    for p, want in zip(prompts, expected):
        out = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                           use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want
        cached.append(out.num_cached_tokens)
    assert cached == [0, 0, 96]


def test_dynamic_rope_stretches_the_context(variant):
    """Dynamic NTK: the context is max_position_embeddings times the factor (64 x 4), and no more."""
    d = variant("dynamic_rope")
    assert LLM(d, dtype="float32", kv_cache_memory_bytes=8 << 20).engine.max_model_len == 256
    with pytest.raises(ValueError, match="times its dynamic rope factor"):
        LLM(d, dtype="float32", max_model_len=300, kv_cache_memory_bytes=8 << 20)


def test_final_logit_softcapping_shapes_the_distribution(variant):
    """Soft-capping is monotonic (greedy tokens cannot show it): the logprobs must be transformers' capped ones."""
    import torch
    from transformers import AutoModelForCausalLM

    from pagedllm import SamplingParams

    d = variant("gemma3_softcap")
    prompt = random_prompts([20], seed=2)[0]
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1]
    want = torch.log_softmax(logits.float(), -1)
    llm = LLM(d, dtype="float32", kv_cache_memory_bytes=8 << 20)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                       use_tqdm=False)[0].outputs[0]
    token = out.token_ids[0]
    assert abs(out.logprobs[0][token].logprob - want[token].item()) < 1e-4
    uncapped = torch.log_softmax(logits * 0 + torch.atanh((logits / 3.0).clamp(-0.999999, 0.999999)) * 3.0, -1)
    assert abs(uncapped[token].item() - want[token].item()) > 1e-3  # the cap moved it


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_experts_share_the_load_and_are_counted(variant, name):
    """Every routed token lands on top_k experts; the load spreads (routing matters), and the counts are the
    engine's per-layer expert load (its stats, exported as metrics)."""
    llm = LLM(variant(name), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=256)
    prompts = random_prompts([40, 9], seed=4)
    ours(llm, prompts, [6, 6])
    load = llm.get_stats().moe_expert_tokens
    computed = sum(len(p) for p in prompts) + 2 * 5  # prompt tokens, then the decodes before the last token
    assert load and all(sum(c) == 2 * computed for c in load.values())  # top-2
    assert all(sum(1 for n in c if n) > 4 for c in load.values())  # more than a few of the 8 experts in use
    if name == "qwen3_moe":
        assert list(load) == [0]  # its last layer is dense (mlp_only_layers)


def test_softcapped_attention_runs_on_the_torch_backend(variant):
    """Gemma 2's soft-capped scores: the kernels have no cap, so the selector keeps the torch backend, and an
    explicit kernel backend falls back to it with the reason."""
    llm = LLM(variant("gemma2"), dtype="float32", kv_cache_memory_bytes=8 << 20)
    assert llm.get_stats().attention_selection["chosen"] == "torch"
    explicit = LLM(variant("gemma2"), dtype="float32", kv_cache_memory_bytes=8 << 20, attention_backend="cpu")
    selection = explicit.get_stats().attention_selection
    why = "soft-capping" if cpu_supported()[0] else cpu_supported()[1]  # a CPU without AVX-512 cannot build it
    assert selection["chosen"] == "torch" and why in selection["reason"]


def test_windows_follow_layer_types(variant):
    llm = LLM(variant("qwen2_window"), dtype="float32", kv_cache_memory_bytes=8 << 20)
    assert [layer.self_attn.sliding_window for layer in llm.engine.executor.model.model.layers] == [None, 24]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp_bias", "phi3", "gemma3", "mixtral", "qwen2_moe"])
def test_under_tensor_parallelism(variant, name):
    d = variant(name)
    prompts = random_prompts(LENGTHS, seed=3)
    llm = LLM(d, dtype="float32", tensor_parallel_size=2, kv_cache_memory_bytes=8 << 20, max_model_len=256)
    try:
        assert ours(llm, prompts, MAX_TOKENS) == hf_greedy(d, prompts, MAX_TOKENS)
    finally:
        llm.shutdown()
