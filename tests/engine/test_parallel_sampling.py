"""n and best_of: samples fork from one prefill, share its blocks by reference count, copy the partly filled
last block on first write, and give exactly what single requests with the derived seeds give."""

import pytest

from conftest import assert_all_blocks_free, random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.engine.scheduler import QueueFullError
from pagedllm.sampling_params import RequestOutputKind

# Around block boundaries (block size 16): a partly filled last block (copied) and a full one (nothing to copy).
LENGTHS = [21, 32, 33, 7, 48]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 24)


def singles(llm, prompt, seeds, **kw):
    params = [SamplingParams(seed=s, **kw) for s in seeds]
    return [
        o.outputs[0]
        for o in llm.generate([{"prompt_token_ids": prompt}] * len(seeds), params, use_tqdm=False)
    ]


def test_n_with_a_seed_equals_single_requests_with_derived_seeds(llm):
    prompts = random_prompts(LENGTHS, seed=11)
    kw = dict(temperature=1.0, top_p=0.9, max_tokens=14)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(n=4, seed=100, **kw), use_tqdm=False
    )
    for prompt, out in zip(prompts, outs):
        assert [c.index for c in out.outputs] == [0, 1, 2, 3]
        expected = singles(llm, prompt, [100, 101, 102, 103], **kw)
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in expected]
        assert [c.text for c in out.outputs] == [c.text for c in expected]
        assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # the samples really differ
    assert_all_blocks_free(llm)


def test_samples_share_the_prompt_blocks_and_copy_only_the_last_one(llm):
    engine = llm.engine
    kv, pool = engine.kv, engine.kv.pool
    prompt = random_prompts([37], seed=2)[0]  # 2 full blocks + 5 tokens
    free_before = pool.num_free_blocks
    engine.add_request(
        {"prompt_token_ids": prompt},
        SamplingParams(n=4, seed=1, temperature=1.0, max_tokens=40, ignore_eos=True),
        request_id="g",
    )
    engine.step()  # the prefill: sample 0 computes the prompt once, all four draw their first token
    ids = [kv.block_ids(f"g#s{i}") for i in range(4)]
    assert ids[0] == ids[1] == ids[2] == ids[3] and len(ids[0]) == 3
    assert [pool.blocks[b].ref_cnt for b in ids[0]] == [4, 4, 4]
    assert free_before - pool.num_free_blocks == 3  # one prompt's blocks, not four
    engine.step()  # each writes its second token into the shared partial block: three copy it, one keeps it
    ids = [kv.block_ids(f"g#s{i}") for i in range(4)]
    assert len({tuple(b[:2]) for b in ids}) == 1 and [pool.blocks[b].ref_cnt for b in ids[0][:2]] == [4, 4]
    assert len({b[2] for b in ids}) == 4 and all(pool.blocks[b[2]].ref_cnt == 1 for b in ids)
    assert free_before - pool.num_free_blocks == 2 + 4
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(llm)


def test_best_of_keeps_the_samples_with_the_highest_cumulative_logprob(llm):
    prompt = random_prompts([19], seed=5)[0]
    kw = dict(temperature=1.0, max_tokens=10, ignore_eos=True)
    out = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(n=2, best_of=5, seed=40, **kw), use_tqdm=False
    )[0]
    every = singles(llm, prompt, range(40, 45), logprobs=0, **kw)
    best = sorted(every, key=lambda c: -c.cumulative_logprob)[:2]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in best]
    assert [c.index for c in out.outputs] == [0, 1]
    assert out.outputs[0].cumulative_logprob == pytest.approx(best[0].cumulative_logprob, abs=1e-4)
    assert all(c.logprobs is None for c in out.outputs)  # not asked for: computed for ranking only
    assert_all_blocks_free(llm)


def test_best_of_cumulative_outputs_hold_the_n_best_so_far(llm):
    """The engine's default output kind (cumulative) with best_of > n: every output holds at most n samples, the
    best so far by cumulative logprob, and the last one the n best (it held all best_of samples)."""
    engine = llm.engine
    prompt = random_prompts([23], seed=6)[0]
    kw = dict(n=2, best_of=4, seed=31, temperature=1.0, max_tokens=9, ignore_eos=True)
    engine.add_request({"prompt_token_ids": prompt}, SamplingParams(**kw), request_id="cumulative")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs and all(len(o.outputs) <= 2 for o in outputs)
    for o in outputs:
        scores = [c.cumulative_logprob for c in o.outputs]
        assert scores == sorted(scores, reverse=True) and [c.index for c in o.outputs] == list(range(len(scores)))
    final = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**kw), use_tqdm=False)[0]
    assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
    assert [c.token_ids for c in outputs[-1].outputs] == [c.token_ids for c in final.outputs]
    assert_all_blocks_free(llm)


def test_streaming_n_says_which_sample_each_delta_belongs_to(llm):
    engine = llm.engine
    prompt = random_prompts([25], seed=8)[0]
    kw = dict(n=3, seed=9, temperature=1.0, max_tokens=12)
    engine.add_request(
        {"prompt_token_ids": prompt},
        SamplingParams(output_kind=RequestOutputKind.DELTA, **kw),
        request_id="stream",
    )
    pieces, tokens, finished = {0: "", 1: "", 2: ""}, {0: [], 1: [], 2: []}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "stream" and len(out.outputs) == 1
            c = out.outputs[0]
            pieces[c.index] += c.text
            tokens[c.index] += c.token_ids
            finished.append(out.finished)
    assert finished[-1] and not any(finished[:-1])
    final = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(**kw), use_tqdm=False)[0]
    assert [pieces[i] for i in range(3)] == [c.text for c in final.outputs]
    assert [tokens[i] for i in range(3)] == [c.token_ids for c in final.outputs]
    assert_all_blocks_free(llm)


def test_samples_under_preemption_give_the_same_tokens(llama_dir):
    prompts = random_prompts([30, 45, 20, 61], seed=3)
    params = SamplingParams(n=3, seed=5, temperature=0.8, max_tokens=30, ignore_eos=True)
    roomy = LLM(llama_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 24)
    expected = [
        [c.token_ids for c in o.outputs]
        for o in roomy.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]
    tight = LLM(
        llama_dir,
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=20 * 16384,
        max_num_batched_tokens=128,
    )
    got = [
        [c.token_ids for c in o.outputs]
        for o in tight.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]
    assert tight.get_stats().num_preemptions > 0
    assert got == expected
    assert_all_blocks_free(tight)


def test_a_group_aborted_or_timed_out_frees_every_block(llm):
    engine = llm.engine
    engine.add_request(
        {"prompt_token_ids": random_prompts([40])[0]},
        SamplingParams(n=4, temperature=1.0, max_tokens=100, ignore_eos=True),
        request_id="a",
    )
    engine.step()
    engine.step()
    out = engine.abort_request("a")
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * 4
    assert_all_blocks_free(llm)
    # Aborted before its first sample forked the others: all four still end.
    engine.add_request(
        {"prompt_token_ids": random_prompts([40])[0]}, SamplingParams(n=4, max_tokens=5), request_id="b"
    )
    out = engine.abort_request("b")
    assert out.finished and len(out.outputs) == 4
    assert_all_blocks_free(llm)


def test_n_and_best_of_are_validated(llm):
    prompt = {"prompt_token_ids": [0, 5, 6]}
    for kw, field in [
        ({"n": 0}, "n"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"n": 1, "best_of": 2, "output_kind": RequestOutputKind.DELTA}, "best_of"),
        ({"n": 1.5}, "n"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    small = llm.engine.config.scheduler.max_num_seqs
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.generate(prompt, SamplingParams(n=small + 1), use_tqdm=False)
    assert_all_blocks_free(llm)


def test_a_full_queue_refuses_a_group_and_registers_nothing(llama_dir):
    llm = LLM(llama_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 24, max_queue_size=1)
    engine = llm.engine
    engine.add_request({"prompt_token_ids": [0, 5, 6]}, SamplingParams(max_tokens=4), request_id="one")
    with pytest.raises(QueueFullError):
        engine.add_request({"prompt_token_ids": [0, 7, 8]}, SamplingParams(n=3, max_tokens=4), request_id="group")
    assert "group" not in engine.groups and list(engine.output_processor.states) == ["one"]
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(llm)
