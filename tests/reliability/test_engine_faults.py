"""Faults injected inside the engine (EngineConfig.fault_injection, a test-only hook), offline.

A failure that belongs to one request (its sampling, its detokenization, its draft proposal) finishes that
request alone, with finish_reason "error" and a message; every other request of the same batch generates
exactly what it would have without the fault, and every block returns to the pool. A failure of the forward
pass is the shared machinery's: it escapes, and LLM.generate releases what it holds."""

from __future__ import annotations

import pytest

from conftest import assert_all_blocks_free, random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.engine.faults import InjectedFault

TRIGGER = 1999  # a token id that random_prompts never draws (they are below 1999 with vocab=1999)
KW = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 16 << 20}


def _prompts():
    prompts = random_prompts([12, 30, 7, 50], vocab=TRIGGER)
    poisoned = prompts[1][:5] + [TRIGGER] + prompts[1][5:]
    return prompts, poisoned


def _texts(outs):
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


@pytest.mark.parametrize("point,spec", [
    ("sample", None),
    ("detokenize", None),
    ("propose", {"method": "ngram", "num_speculative_tokens": 3}),
])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_request_failure_ends_that_request_alone(llama_dir, point, spec, temperature):
    prompts, poisoned = _prompts()
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=20, ignore_eos=True)
    extra = {"speculative_config": spec} if spec else {}
    clean = LLM(llama_dir, **KW, **extra).generate(prompts, params, use_tqdm=False)
    llm = LLM(llama_dir, **KW, **extra, fault_injection={"point": point, "token_id": TRIGGER})
    batch = [prompts[0], poisoned, prompts[2], prompts[3]]
    outs = llm.generate(batch, params, use_tqdm=False)
    failed = outs[1]
    assert failed.finished and failed.outputs[0].finish_reason == "error"
    assert f"injected {point} fault" in failed.error
    others = [outs[0], outs[2], outs[3]]
    assert _texts(others) == _texts([clean[0], clean[2], clean[3]])
    assert all(o.error is None for o in others)
    assert llm.get_stats().requests_finished == {"length": 3, "error": 1}
    assert_all_blocks_free(llm)
    # The engine goes on serving: the same batch without the poisoned prompt is untouched.
    assert _texts(llm.generate(prompts, params, use_tqdm=False)) == _texts(clean)
    assert_all_blocks_free(llm)


def test_a_sampler_that_breaks_on_one_request_costs_only_that_request(llama_dir, monkeypatch):
    """Not the hook: a real exception from inside the batched sampler (a penalty applied to a request whose
    state is broken) is traced to its request by sampling each alone."""
    from pagedllm.engine import sampler

    prompts, _ = _prompts()
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.2 if i == 2 else 1.0)
              for i in range(4)]
    clean = LLM(llama_dir, **KW).generate(prompts, params, use_tqdm=False)
    llm = LLM(llama_dir, **KW)

    def broken_penalties(row, req):
        raise IndexError("index 1000000 is out of bounds for dimension 0")

    monkeypatch.setattr(sampler, "_apply_penalties", broken_penalties)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert outs[2].outputs[0].finish_reason == "error" and "IndexError" in outs[2].error
    assert _texts([outs[i] for i in (0, 1, 3)]) == _texts([clean[i] for i in (0, 1, 3)])
    assert_all_blocks_free(llm)


def test_a_forward_failure_escapes_and_generate_releases_its_blocks(llama_dir):
    prompts, poisoned = _prompts()
    llm = LLM(llama_dir, **KW, fault_injection={"point": "forward", "token_id": TRIGGER})
    with pytest.raises(InjectedFault):
        llm.generate([prompts[0], poisoned], SamplingParams(max_tokens=5), use_tqdm=False)
    assert_all_blocks_free(llm)
    assert len(llm.generate(prompts, SamplingParams(max_tokens=5), use_tqdm=False)) == 4


def test_a_bad_element_leaves_nothing_queued(llama_dir):
    """LLM.generate validates the whole batch before it queues anything."""
    llm = LLM(llama_dir, **KW)
    prompts, _ = _prompts()
    for bad_params in ([SamplingParams(max_tokens=4)] * 3 + [SamplingParams(stop_token_ids=[10 ** 9])],
                       [SamplingParams(max_tokens=4)] * 3 + [SamplingParams(logprobs=21)]):
        with pytest.raises(ValueError):
            llm.generate(prompts, bad_params, use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
        assert_all_blocks_free(llm)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate(prompts[:3] + [[0, 10 ** 9]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
