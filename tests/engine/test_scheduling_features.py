"""Prefix caching, chunked prefill, priority with preemption, deadlines and the bounded queue, end to end
through the offline engine (fp32, tiny models)."""

import pytest

from conftest import assert_all_blocks_free, random_prompts
from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.engine.scheduler import QueueFullError

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def shared_prefix_prompts(prefix_len=70, n=8, seed=0):
    """n prompts sharing a prefix that ends mid-block (70 = 4 blocks of 16 + 6), with distinct tails."""
    base = random_prompts([prefix_len], seed=seed)[0]
    tails = random_prompts([5 + 3 * i for i in range(n)], seed=seed + 1)
    return [base + t[1:] for t in tails]


def run(llm, prompts, params=GREEDY, abort_after=None):
    engine = llm.engine
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
        steps += 1
        if abort_after is not None and steps == abort_after:
            engine.abort_request(ids[1])
    return [done.get(i) for i in ids]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefix_caching_on_and_off_give_identical_tokens(model_dir, arch):
    d = model_dir(arch)
    prompts = shared_prefix_prompts()
    kw = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=64 << 20)
    off = LLM(d, enable_prefix_caching=False, **kw)
    on = LLM(d, **kw)
    expected = run(off, prompts)
    first = run(on, prompts[:1])  # warm the cache with one request, then the batch hits it
    assert first == expected[:1]
    assert run(on, prompts) == expected
    stats = on.get_stats()
    assert stats.prefix_cache_hits >= 7 * 64  # the 4 full shared blocks, for every later request
    assert stats.prefix_cache_queries >= stats.prefix_cache_hits
    assert_all_blocks_free(on)
    assert on.reset_prefix_cache() and on.engine.kv.pool.cached == {}


def test_prefix_caching_identical_under_preemption_and_abort(model_dir):
    d = model_dir("llama")
    prompts = shared_prefix_prompts(prefix_len=40, n=8, seed=5)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(dtype="float32", max_model_len=128, kv_cache_memory_bytes=14 * 16384, max_num_batched_tokens=128)
    off = LLM(d, enable_prefix_caching=False, **kw)
    on = LLM(d, **kw)
    expected = run(off, prompts, params, abort_after=6)
    got = run(on, prompts, params, abort_after=6)
    assert on.get_stats().num_preemptions > 0 and off.get_stats().num_preemptions > 0
    assert got[1] is None and expected[1] is None  # the aborted one
    assert got == expected
    assert on.get_stats().prefix_cache_hits > 0
    assert_all_blocks_free(on)
    assert_all_blocks_free(off)


def test_guaranteed_no_evict_gives_the_same_tokens_without_preemption(model_dir):
    """Both capacity policies on a pool too small for every request at its longest: the same greedy tokens,
    max_utilization by preempting and recomputing, guaranteed_no_evict by admitting fewer at once."""
    d = model_dir("llama")
    prompts = random_prompts([30 + 7 * i for i in range(8)], seed=11)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(dtype="float32", max_model_len=128, kv_cache_memory_bytes=20 * 16384, max_num_batched_tokens=128)
    default = LLM(d, **kw)
    no_evict = LLM(d, capacity_scheduler_policy="guaranteed_no_evict", **kw)
    expected = run(default, prompts, params)
    assert run(no_evict, prompts, params) == expected
    assert all(len(t) == 40 for t in expected)
    assert default.get_stats().num_preemptions > 0
    assert no_evict.get_stats().num_preemptions == 0
    assert_all_blocks_free(default)
    assert_all_blocks_free(no_evict)


def test_guaranteed_no_evict_runs_groups_of_samples_and_beams_to_the_end(model_dir):
    """Forked sequences on a pool that holds few of them at their longest: every group finishes whole."""
    llm = LLM(model_dir("llama"), dtype="float32", max_model_len=128, kv_cache_memory_bytes=20 * 16384,
              max_num_batched_tokens=128, capacity_scheduler_policy="guaranteed_no_evict")
    prompts = [{"prompt_token_ids": p} for p in random_prompts([30, 45, 60], seed=12)]
    outs = llm.generate(prompts, SamplingParams(n=3, seed=4, temperature=1.0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)
    assert [[len(c.token_ids) for c in o.outputs] for o in outs] == [[40] * 3] * 3
    assert_all_blocks_free(llm)
    beams = llm.beam_search(prompts[:2], BeamSearchParams(beam_width=3, max_tokens=30, ignore_eos=True))
    assert [[len(c.token_ids) for c in b.outputs] for b in beams] == [[30] * 3] * 2
    assert_all_blocks_free(llm)


def beam_search_steps(llm, prompt, params, max_steps):
    """(the beams' tokens, steps taken) of one beam search, failing past max_steps rather than hanging."""
    engine, beams = llm.engine, None
    rid = engine.add_request({"prompt_token_ids": prompt}, params.sampling_params())
    for step in range(1, max_steps + 1):
        for o in engine.step():
            if o.request_id == rid and o.finished:
                beams = [c.token_ids for c in o.outputs]
        if not engine.has_unfinished_requests():
            return beams, step
    raise AssertionError(f"beam search still running after {max_steps} steps "
                         f"({llm.get_stats().num_preemptions} preemptions)")


@pytest.mark.parametrize("policy", ["max_utilization", "guaranteed_no_evict"])
@pytest.mark.parametrize("width", [10, 16])
def test_beams_wider_than_the_pool_take_turns_and_finish(model_dir, policy, width):
    """A pool of 19 blocks holds 10 beams of a 60-token prompt only while they share most of their blocks,
    and 16 hardly: an idle beam yields its blocks, and is not readmitted before its group has chosen (it was, and
    took the room back at once: the search never ended). The beams are those of an ample pool."""
    d = model_dir("llama")
    prompt = random_prompts([60], seed=21)[0]
    params = BeamSearchParams(beam_width=width, max_tokens=60, ignore_eos=True)
    kw = dict(dtype="float32", max_model_len=128, capacity_scheduler_policy=policy)
    expected, _ = beam_search_steps(LLM(d, kv_cache_memory_bytes=64 << 20, **kw), prompt, params, 200)
    tight = LLM(d, kv_cache_memory_bytes=20 * 16384, **kw)
    got, steps = beam_search_steps(tight, prompt, params, 20 * 60)
    assert got == expected and len(got) == width and all(len(t) == 60 for t in got)
    assert tight.get_stats().num_preemptions > 0
    assert_all_blocks_free(tight)


def test_chunked_prefill_on_and_off_identical_and_decodes_keep_running(model_dir):
    d = model_dir("llama")
    kw = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=32 << 20)
    short = random_prompts([6, 9], seed=3)
    long_prompt = random_prompts([400], seed=4)[0]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    def scenario(llm):
        """Two short requests decode; a long prompt arrives after 3 steps. Returns tokens and schedules."""
        engine = llm.engine
        schedules = []
        original = engine.scheduler.schedule

        def recording():
            out = original()
            schedules.append({s.request.request_id: s.num_tokens for s in out.scheduled})
            return out

        engine.scheduler.schedule = recording
        ids = [engine.add_request({"prompt_token_ids": p}, params) for p in short]
        done = {}
        for step in range(1000):
            if step == 3:
                ids.append(engine.add_request({"prompt_token_ids": long_prompt}, params))
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
            if not engine.has_unfinished_requests():
                break
        return [done[i] for i in ids], schedules, ids

    chunked, sched_on, ids = scenario(LLM(d, max_num_batched_tokens=64, **kw))
    whole, sched_off, _ = scenario(LLM(d, enable_chunked_prefill=False, max_num_batched_tokens=512, **kw))
    assert chunked == whole
    long_id = ids[2]
    chunk_steps = [s for s in sched_on if long_id in s and s[long_id] > 1]
    assert len(chunk_steps) >= 6  # 400 prompt tokens in chunks of at most 64 - 2
    for s in chunk_steps:  # every step that carries a chunk also carries both running decodes
        if ids[0] in s or ids[1] in s:
            assert s.get(ids[0]) == 1 and s.get(ids[1]) == 1 and sum(s.values()) <= 64
    assert all(s.get(ids[0]) == 1 for s in chunk_steps if len(s) > 1)
    # Without chunking the whole prompt goes in one step.
    assert max(s.get(long_id, 0) for s in sched_off) == 400


def test_priority_overtakes_the_queue_and_preempts_under_kv_pressure(model_dir):
    d = model_dir("llama")
    prompts = random_prompts([30, 31, 32, 33], seed=8)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    reference = run(LLM(d, dtype="float32", max_model_len=128), prompts, params)

    # 9 usable blocks: two requests of 80 tokens (5 blocks each) cannot both finish.
    llm = LLM(d, dtype="float32", max_model_len=128, kv_cache_memory_bytes=10 * 16384, max_num_seqs=2,
              scheduling_policy="priority")
    engine = llm.engine
    low = [engine.add_request({"prompt_token_ids": p}, params, priority=5) for p in prompts[:3]]
    engine.step()
    engine.step()
    high = engine.add_request({"prompt_token_ids": prompts[3]}, params, priority=0)  # arrives late
    order, done = [], {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
                order.append(o.request_id)
    reqs = {r: done[r] for r in low + [high]}
    assert [reqs[r] for r in low + [high]] == reference
    assert order.index(high) < order.index(low[2])  # overtook the queued low-priority request
    assert order[0] == high  # and preempted a running low-priority one to finish first
    assert engine.get_stats().num_preemptions >= 1
    assert_all_blocks_free(llm)


def test_priority_through_generate(model_dir):
    llm = LLM(model_dir("llama"), dtype="float32", max_model_len=128, scheduling_policy="priority")
    outs = llm.generate(["a", "b"], GREEDY, priority=[3, 1], use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    with pytest.raises(ValueError, match="priority"):
        llm.generate(["a", "b"], GREEDY, priority=[1], use_tqdm=False)


def test_deadlines_finish_running_and_queued_requests(model_dir):
    llm = LLM(model_dir("llama"), dtype="float32", max_model_len=2048, max_num_seqs=1)
    long_params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
    outs = llm.generate(["def main():", "import os"], long_params, timeout=[0.3, 0.1], use_tqdm=False)
    running, queued = outs[0].outputs[0], outs[1].outputs[0]
    assert running.finish_reason == "timeout" and 0 < len(running.token_ids) < 2000
    assert queued.finish_reason == "timeout" and queued.token_ids == []  # never started
    assert_all_blocks_free(llm)
    with pytest.raises(ValueError, match="timeout"):
        llm.generate("x", GREEDY, timeout=0, use_tqdm=False)


def test_bounded_queue_rejects_with_overloaded(model_dir):
    llm = LLM(model_dir("llama"), dtype="float32", max_model_len=128, max_queue_size=2)
    engine = llm.engine
    engine.add_request("a", GREEDY)
    engine.add_request("b", GREEDY)
    with pytest.raises(QueueFullError, match="overloaded"):
        engine.add_request("c", GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("c", GREEDY)  # room again
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(llm)
