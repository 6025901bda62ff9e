"""prompt_logprobs (vLLM's semantics), truncate_prompt_tokens and detokenize=False, each shown by its effect on
the tiny model's outputs: prompt entries equal a per-prefix reference, whole or in prefill chunks, with the
prefix cache warm, and under preemption (no entry twice)."""

from __future__ import annotations

import pytest

from conftest import assert_all_blocks_free, random_prompts
from pagedllm import LLM, SamplingParams

KW = dict(dtype="float32", max_model_len=256)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, kv_cache_memory_bytes=1 << 24, **KW)


def reference(llm, prompt: list[int], k: int) -> list:
    """Entry p + 1 from a one-token generation after prompt[:p + 1], with that step's logprobs."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=max(k, 1), ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": prompt[:p + 1]} for p in range(len(prompt) - 1)], params,
                        use_tqdm=False)
    return [o.outputs[0].logprobs[0] for o in outs]


def assert_entries_match(got: list, prompt: list[int], ref: list, k: int):
    assert len(got) == len(prompt) and got[0] is None
    for p, (entry, want) in enumerate(zip(got[1:], ref), start=1):
        tok = prompt[p]
        assert tok in entry and len(entry) <= k + 1
        top = sorted((t for t in entry if entry[t].rank <= k or t != tok), key=lambda t: entry[t].rank)[:k]
        want_top = sorted(want, key=lambda t: want[t].rank)[:k]
        assert top == want_top
        for t in top:
            assert entry[t].logprob == pytest.approx(want[t].logprob, abs=1e-4)
        # the actual token's logprob and rank, under the raw distribution
        full = {t: lp for t, lp in want.items()}
        if tok in full:
            assert entry[tok].logprob == pytest.approx(full[tok].logprob, abs=1e-4)
            assert entry[tok].rank == full[tok].rank


def test_prompt_logprobs_equal_per_prefix_reference(llm):
    prompt = random_prompts([12], seed=7)[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3),
                       use_tqdm=False)[0]
    assert_entries_match(out.prompt_logprobs, prompt, reference(llm, prompt, 20), 3)
    assert all(isinstance(lp.decoded_token, str) for e in out.prompt_logprobs[1:] for lp in e.values())
    # prompt_logprobs=0: the actual token's entry alone
    zero = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)[0].prompt_logprobs
    assert [list(e) for e in zero[1:]] == [[t] for t in prompt[1:]]
    # without the parameter: none, and the generated tokens are the same
    plain = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == out.outputs[0].token_ids


def test_prompt_logprobs_over_chunks_with_warm_prefix_cache(llama_dir, llm):
    prompt = random_prompts([40], seed=8)[0]
    whole = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2),
                         use_tqdm=False)[0]
    chunked = LLM(llama_dir, kv_cache_memory_bytes=1 << 24, max_num_batched_tokens=7, **KW)
    warm = chunked.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert warm[0].outputs[0].token_ids == whole.outputs[0].token_ids
    got = chunked.generate({"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2), use_tqdm=False)[0]
    assert got.num_cached_tokens == 0  # every position computed, so none taken from the (warm) cache
    assert_entries_match(got.prompt_logprobs, prompt, [e for e in whole.prompt_logprobs[1:]], 2)
    assert_all_blocks_free(chunked)


def test_prompt_logprobs_under_preemption_are_not_duplicated(llama_dir, llm):
    prompts = random_prompts([60, 50, 70, 45, 55, 65], seed=9)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=1)
    ample = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tight = LLM(llama_dir, dtype="float32", max_model_len=128, kv_cache_memory_bytes=10 * 16384,
                max_num_batched_tokens=32)
    got = tight.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert tight.get_stats().num_preemptions > 0
    for prompt, a, g in zip(prompts, ample, got):
        assert g.outputs[0].token_ids == a.outputs[0].token_ids
        assert_entries_match(g.prompt_logprobs, prompt, a.prompt_logprobs[1:], 1)
    assert_all_blocks_free(tight)


def test_truncate_prompt_tokens_keeps_the_last_k(llm):
    prompt = random_prompts([30], seed=10)[0]
    params = dict(temperature=0, max_tokens=5, ignore_eos=True)
    cut = llm.generate({"prompt_token_ids": prompt}, SamplingParams(truncate_prompt_tokens=8, **params),
                       use_tqdm=False)[0]
    tail = llm.generate({"prompt_token_ids": prompt[-8:]}, SamplingParams(**params), use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-8:]
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids
    # longer than the prompt: the whole prompt
    whole = llm.generate({"prompt_token_ids": prompt}, SamplingParams(truncate_prompt_tokens=100, **params),
                         use_tqdm=False)[0]
    assert whole.prompt_token_ids == prompt


def test_detokenize_false_gives_token_ids_without_text(llm):
    params = dict(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    with_text = llm.generate("def main():", SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    ids_only = llm.generate("def main():", SamplingParams(detokenize=False, **params), use_tqdm=False)[0].outputs[0]
    assert with_text.text and ids_only.text == ""
    assert ids_only.token_ids == with_text.token_ids
    assert all(lp.decoded_token is None for e in ids_only.logprobs for lp in e.values())


@pytest.mark.parametrize("params, message", [
    ({"prompt_logprobs": -1}, "prompt_logprobs: must be an integer >= 0"),
    ({"prompt_logprobs": 10 ** 6}, "prompt_logprobs: 1000000 requested, at most"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens: must be an integer in [1, 2^31 - 1]"),
    ({"detokenize": False, "stop": ["x"]}, "stop: stop strings need detokenize=True"),
    ({"detokenize": "no"}, "detokenize: must be a boolean"),
])
def test_bad_values_are_refused(llm, params, message):
    with pytest.raises(ValueError) as e:
        llm.generate("hi", SamplingParams(**params), use_tqdm=False)
    assert message in str(e.value)
