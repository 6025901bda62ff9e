"""Greedy outputs are token-identical to HF transformers on the same weights (fp32)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import ARCHS, assert_all_blocks_free, random_prompts
from pagedllm import LLM, SamplingParams

LENGTHS = [1, 5, 17, 40, 100, 310, 64, 15, 129]
MAX_TOKENS = [20, 5, 33, 16, 8, 24, 40, 3, 12]


def hf_greedy(model_dir, prompts, max_tokens, ignore_eos=True):
    """transformers' greedy tokens; `model_dir` may also be a loaded model (e.g. with an adapter merged)."""
    hf = (AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32) if isinstance(model_dir, str)
          else model_dir).eval()
    out = []
    for p, m in zip(prompts, max_tokens):
        kwargs = {"min_new_tokens": m} if ignore_eos else {}
        with torch.no_grad():
            ids = hf.generate(torch.tensor([p]), max_new_tokens=m, do_sample=False, **kwargs)[0, len(p):]
        out.append(ids.tolist())
    return out


def ours(llm, prompts, max_tokens, ignore_eos=True):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=ignore_eos) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(LENGTHS)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers(model_dir, arch, prompts):
    d = model_dir(arch)
    expected = hf_greedy(d, prompts, MAX_TOKENS)
    llm = LLM(d, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=32 << 20)
    assert ours(llm, prompts, MAX_TOKENS) == expected
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_matches_transformers_under_preemption(model_dir, arch, prompts):
    d = model_dir(arch)
    expected = hf_greedy(d, prompts, MAX_TOKENS)
    # 23 usable blocks of 16 tokens for ~1100 tokens of demand: requests must be preempted and recomputed.
    llm = LLM(d, dtype="float32", max_model_len=352, kv_cache_memory_bytes=24 * 16384,
              max_num_batched_tokens=256)
    assert ours(llm, prompts, MAX_TOKENS) == expected
    assert llm.get_stats().num_preemptions > 0
    assert_all_blocks_free(llm)


def test_eos_stops_like_transformers(model_dir):
    """Without ignore_eos both stop at EOS; force it to appear by making EOS the likeliest next token."""
    d = model_dir("llama")
    prompts = random_prompts([12, 30], seed=3)
    llm = LLM(d, dtype="float32", max_model_len=512, kv_cache_memory_bytes=16 << 20)
    first = ours(llm, prompts, [6, 6])
    # Declare each prompt's 3rd greedy token as EOS: both engines must stop right there.
    import json
    import os
    import shutil
    import tempfile

    tmp = tempfile.mkdtemp()
    shutil.copytree(d, tmp, dirs_exist_ok=True)
    eos = first[0][2]
    with open(os.path.join(tmp, "generation_config.json")) as f:
        gen = json.load(f)
    gen["eos_token_id"] = [1, eos]
    with open(os.path.join(tmp, "generation_config.json"), "w") as f:
        json.dump(gen, f)
    expected = hf_greedy(tmp, prompts, [20, 20], ignore_eos=False)
    llm2 = LLM(tmp, dtype="float32", max_model_len=512, kv_cache_memory_bytes=16 << 20)
    outs = llm2.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=20),
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert outs[0].outputs[0].token_ids[-1] == eos and outs[0].outputs[0].finish_reason == "stop"
    assert_all_blocks_free(llm2)


def test_sharded_checkpoint_and_prefix_caching_off_give_the_same_tokens(model_dir, prompts):
    sharded = model_dir("qwen2", max_shard_size="300KB")
    import os

    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    plain = model_dir("qwen2")
    a = ours(LLM(plain, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=32 << 20), prompts, MAX_TOKENS)
    b = ours(LLM(sharded, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=32 << 20,
                 enable_prefix_caching=False), prompts, MAX_TOKENS)
    assert a == b


def test_bfloat16_runs_and_mostly_agrees(model_dir, prompts):
    """bf16 cannot be token-identical to fp32; it must run and agree on most first tokens."""
    d = model_dir("llama")
    fp32 = ours(LLM(d, dtype="float32", max_model_len=1024), prompts, MAX_TOKENS)
    bf16 = ours(LLM(d, dtype="bfloat16", max_model_len=1024), prompts, MAX_TOKENS)
    agree = sum(a[0] == b[0] for a, b in zip(fp32, bf16))
    assert agree >= len(prompts) - 2


def test_packed_bf16_linears_change_no_token(model_dir, prompts, monkeypatch):
    """Packed bf16 linears (our AMX kernel, or oneDNN elsewhere) must change no greedy token."""
    d = model_dir("qwen2")
    packed = LLM(d, dtype="bfloat16", max_model_len=1024)
    n_packed = sum(type(m).__name__ == "PackedLinear" for m in packed.engine.executor.model.modules())
    monkeypatch.setattr("pagedllm.engine.executor.worker.pack_linears", lambda model, use_amx: 0)
    plain = LLM(d, dtype="bfloat16", max_model_len=1024)
    if n_packed == 0:
        pytest.skip("oneDNN packing is not available on this machine")
    assert n_packed == 4 * 2 + 1  # per layer qkv, o, gate_up, down (2 layers), plus lm_head
    assert ours(packed, prompts, MAX_TOKENS) == ours(plain, prompts, MAX_TOKENS)
