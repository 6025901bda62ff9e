"""Property-based fuzzing (hypothesis) of continuous batching through the offline engine: whatever mix of
requests (lengths, greedy, seeded samples, best_of, beams wider than the pool; logprobs, penalties, min_tokens,
prompt logprobs; priorities, arrivals mid-batch, aborts) meets whatever small KV pool and scheduling options
(capacity policy, FCFS or priority, chunked prefill, prefix caching, n-gram speculation), every request ends
within a bounded number of steps with the tokens it gets alone on an ample pool without speculation, and every
block is back in the pool. What it found: wide beams that never finished (an idle beam yielded its blocks and
took them straight back), best_of's cumulative outputs that held every sample, and seeded samples whose tokens
changed with the drafts the token budget left them."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conftest import assert_all_blocks_free, random_prompts
from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 128  # 8 blocks of 16: the smallest pool drawn (10 blocks) still holds any one sequence
BASE = dict(dtype="float32", max_model_len=MAX_MODEL_LEN)


@st.composite
def requests(draw):
    """One request: its prompt, parameters, priority, the step it arrives at and the step it is aborted at."""
    prompt_len = draw(st.integers(1, 100))
    max_tokens = draw(st.integers(1, min(40, MAX_MODEL_LEN - prompt_len)))
    kind = draw(st.sampled_from(["greedy", "samples", "best_of", "beams"]))
    common = dict(max_tokens=max_tokens, ignore_eos=draw(st.booleans()))
    if kind != "beams":  # what keeps a request off speculation, or off the prefix cache (prompt logprobs)
        common.update(logprobs=draw(st.sampled_from([None, 0, 2])),
                      min_tokens=draw(st.integers(0, min(3, max_tokens))),
                      repetition_penalty=draw(st.sampled_from([1.0, 1.3])),
                      prompt_logprobs=draw(st.sampled_from([None, None, 1])))
    if kind == "greedy":
        params = SamplingParams(temperature=0, **common)
    elif kind == "samples":
        params = SamplingParams(n=draw(st.integers(2, 6)), temperature=1.0, seed=draw(st.integers(0, 99)), **common)
    elif kind == "best_of":
        params = SamplingParams(n=1, best_of=draw(st.integers(2, 4)), temperature=1.0,
                                seed=draw(st.integers(0, 99)), **common)
    else:
        width = draw(st.integers(2, 12))
        params = SamplingParams(beam_width=width, n=width, temperature=0, **common)
    abort_at = draw(st.none() | st.integers(0, 30))
    return dict(prompt=random_prompts([prompt_len], seed=draw(st.integers(0, 10 ** 6)))[0], params=params,
                priority=draw(st.integers(-2, 2)), arrive_at=draw(st.integers(0, 12)), abort_at=abort_at)


engine_options = st.fixed_dictionaries({
    "kv_cache_memory_bytes": st.integers(10, 24).map(lambda blocks: (blocks + 1) * 16384),  # one block is held back
    "capacity_scheduler_policy": st.sampled_from(["max_utilization", "guaranteed_no_evict"]),
    "scheduling_policy": st.sampled_from(["fcfs", "priority"]),
    "enable_chunked_prefill": st.booleans(),
    "enable_prefix_caching": st.booleans(),
    "max_num_batched_tokens": st.sampled_from([32, 128, 512]),
    "max_num_seqs": st.sampled_from([4, 16, 64]),
    "speculative_config": st.none() | st.just({"method": "ngram", "num_speculative_tokens": 3}),
})


def _alone(reference, request: dict) -> list[list[int]]:
    """The request's sequences' tokens when it runs alone on an ample pool."""
    out = reference.generate([{"prompt_token_ids": request["prompt"]}], request["params"], use_tqdm=False)[0]
    return [c.token_ids for c in out.outputs]


def _step_bound(reqs: list[dict]) -> int:
    """Generous, yet finite: every sequence recomputed from scratch for each of its tokens would stay under it."""
    return 200 + sum(r["params"].num_sequences * (len(r["prompt"]) + r["params"].max_tokens) * 4 for r in reqs)


@pytest.fixture(scope="module")
def reference(model_dir):
    """An ample pool, no speculation (verification draws a seeded sample's tokens as plain decoding does)."""
    return LLM(model_dir("llama"), kv_cache_memory_bytes=64 << 20, **BASE)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(options=engine_options, reqs=st.lists(requests(), min_size=1, max_size=6))
def test_any_mix_of_requests_ends_with_its_tokens_and_every_block_back(model_dir, reference, options, reqs):
    if options["enable_chunked_prefill"] is False:
        options = {**options, "max_num_batched_tokens": max(options["max_num_batched_tokens"], MAX_MODEL_LEN)}
    llm = LLM(model_dir("llama"), **BASE, **options)
    engine = llm.engine
    ids: dict[int, str] = {}  # request index -> its id, once added
    finals: dict[str, list[list[int]]] = {}
    refused, aborted = set(), set()
    step, bound = 0, _step_bound(reqs)
    while len(ids) + len(refused) < len(reqs) or engine.has_unfinished_requests():
        for i, r in enumerate(reqs):
            if r["arrive_at"] == step:
                prompt = {"prompt_token_ids": r["prompt"]}
                if r["params"].num_sequences > options["max_num_seqs"]:
                    with pytest.raises(ValueError, match="max_num_seqs"):
                        engine.add_request(prompt, r["params"], priority=r["priority"])
                    refused.add(i)
                    continue
                ids[i] = engine.add_request(prompt, r["params"], priority=r["priority"])
            if i in ids and r["abort_at"] is not None and r["arrive_at"] + r["abort_at"] == step:
                out = engine.abort_request(ids[i])
                if out is not None:  # it was still running: its tokens so far
                    aborted.add(i)
                    finals[ids[i]] = [c.token_ids for c in out.outputs]
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = [c.token_ids for c in out.outputs]
        step += 1
        assert step <= bound, f"still running after {step} steps ({llm.get_stats().num_preemptions} preemptions)"
    assert_all_blocks_free(llm)
    event(f"preempted: {llm.get_stats().num_preemptions > 0}")
    event(f"aborted while running: {bool(aborted)}")
    for i, r in enumerate(reqs):
        if i in refused:
            continue
        alone = _alone(reference, r)
        if i not in aborted:
            assert finals[ids[i]] == alone, (i, r)
        elif r["params"].beam_width == 1 and r["params"].best_of is None:  # a beam's or best-of's may yet change
            for got, whole in zip(finals[ids[i]], alone):
                assert got == whole[:len(got)], (i, r)
