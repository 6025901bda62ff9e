"""The generic fallback: architectures the registry does not know (GPT-NeoX, StableLM) run transformers' model
class with our paged attention, and give transformers' greedy tokens (fp32) with continuous batching, with and
without preemption, and with prefix-cache hits; what the fallback cannot do is refused at start."""

import logging

import pytest

from conftest import assert_all_blocks_free, random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.tiny_model import make_variant_model
from test_oracle import hf_greedy, ours
from test_variants import block_bytes

LENGTHS = [3, 30, 70, 120, 9, 50]
MAX_TOKENS = [12, 40, 20, 16, 30, 8]


@pytest.fixture(scope="module")
def fallback_dir(tmp_path_factory):
    made = {}

    def get(arch):
        if arch not in made:
            made[arch] = make_variant_model(str(tmp_path_factory.mktemp(arch)), arch=arch)
        return made[arch]

    return get


@pytest.mark.parametrize("preempt", [False, True], ids=["roomy", "preempting"])
@pytest.mark.parametrize("arch", ["gpt_neox", "stablelm"])
def test_fallback_matches_transformers(fallback_dir, arch, preempt, caplog):
    d = fallback_dir(arch)
    prompts = random_prompts(LENGTHS, seed=5)
    expected = hf_greedy(d, prompts, MAX_TOKENS)
    kwargs = dict(kv_cache_memory_bytes=20 * block_bytes(d), max_num_batched_tokens=96) if preempt else {}
    with caplog.at_level(logging.WARNING):
        llm = LLM(d, dtype="float32", max_model_len=160, **{"kv_cache_memory_bytes": 16 << 20, **kwargs})
    assert "not a native pagedllm architecture" in caplog.text  # logged as the fallback
    assert ours(llm, prompts, MAX_TOKENS) == expected
    assert (llm.get_stats().num_preemptions > 0) == preempt
    assert_all_blocks_free(llm)


def test_fallback_hits_the_prefix_cache(fallback_dir):
    d = fallback_dir("stablelm")
    shared = random_prompts([64], seed=6)[0]
    prompts = [shared + p[1:] for p in random_prompts([10, 20], seed=7)]
    expected = hf_greedy(d, prompts, [8, 8])
    llm = LLM(d, dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    first = ours(llm, prompts[:1], [8])
    second = llm.generate([{"prompt_token_ids": prompts[1]}], SamplingParams(temperature=0, max_tokens=8,
                                                                               ignore_eos=True), use_tqdm=False)[0]
    assert [first[0], second.outputs[0].token_ids] == expected and second.num_cached_tokens == 64


def test_what_the_fallback_cannot_do_is_refused(fallback_dir):
    d = fallback_dir("gpt_neox")
    with pytest.raises(ValueError, match="transformers fallback, which supports neither"):
        LLM(d, dtype="float32", kv_cache_memory_bytes=8 << 20, enable_lora=True)


def test_model_impl_chooses_the_fallback_or_refuses_it(model_dir, fallback_dir):
    """model_impl "transformers" runs a native family through the fallback (same tokens); "pagedllm" refuses an
    architecture it has no class for."""
    d = model_dir("qwen2")
    prompts = random_prompts([20, 45], seed=8)
    via_hf = LLM(d, dtype="float32", kv_cache_memory_bytes=8 << 20, model_impl="transformers")
    assert getattr(via_hf.engine.executor.model, "is_fallback", False)
    assert ours(via_hf, prompts, [10, 10]) == hf_greedy(d, prompts, [10, 10])
    from pagedllm.models.registry import UnsupportedArchitectureError

    with pytest.raises(UnsupportedArchitectureError, match="GPTNeoXForCausalLM"):
        LLM(fallback_dir("gpt_neox"), dtype="float32", kv_cache_memory_bytes=8 << 20, model_impl="pagedllm")
