"""Scheduler and KV-cache-manager unit tests on CPU with a dozen blocks: exact block ids, budgets,
preemption order and status transitions (no model involved)."""

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.request import InvalidTransition, Request, RequestStatus
from pagedllm.engine.scheduler import QueueFullError, Scheduler
from pagedllm.sampling_params import SamplingParams

BS = 4


def make_req(rid, n, priority=0, arrival=None, tokens=None, max_tokens=1000):
    ids = tokens if tokens is not None else [100 + i for i in range(n)]
    return Request(str(rid), ids, SamplingParams(temperature=0), {1}, BS, priority=priority,
                   arrival_time=arrival, max_tokens=max_tokens)


def make_sched(num_blocks=13, budget=64, max_seqs=8, chunked=True, policy="fcfs", caching=True, queue=None,
               capacity="max_utilization"):
    kv = KVCacheManager(num_blocks, BS, caching)
    cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                          scheduling_policy=policy, max_queue_size=queue, capacity_scheduler_policy=capacity)
    return Scheduler(cfg, kv, max_model_len=1000), kv


def run_step(sched, token=7):
    out = sched.schedule()
    sched.update_from_output(out, {s.request.request_id: [token] for s in out.scheduled})
    return out


def test_blocks_grow_one_at_a_time_with_exact_ids():
    sched, kv = make_sched()
    r = make_req("a", 6)
    sched.add_request(r)
    out = run_step(sched)
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("a", 6)]
    assert kv.block_ids("a") == [1, 2]  # 6 tokens -> 2 blocks of 4, nothing reserved beyond
    run_step(sched)  # token 7 (index 6) computed: still 2 blocks
    assert kv.block_ids("a") == [1, 2]
    run_step(sched)  # index 7
    run_step(sched)  # index 8 needs a third block
    assert kv.block_ids("a") == [1, 2, 3]
    assert r.num_computed_tokens == 9 and r.num_tokens == 10
    sched.finish_request(r, RequestStatus.FINISHED_LENGTH)
    # freed tail first: 3, 2, 1 at the queue's tail
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7, 8, 9, 10, 11, 12, 3, 2, 1]
    assert kv.all_free()


def test_token_budget_chunks_a_long_prompt_and_keeps_decodes_running():
    sched, kv = make_sched(num_blocks=40, budget=8)
    a = make_req("a", 3)
    sched.add_request(a)
    run_step(sched)  # a prefilled, now decoding
    b = make_req("b", 20)
    sched.add_request(b)
    chunks = []
    while b.num_output_tokens == 0:
        out = run_step(sched)
        sizes = {s.request.request_id: s.num_tokens for s in out.scheduled}
        assert sizes["a"] == 1  # a decodes every step while b's prompt is chunked
        chunks.append(sizes["b"])
        assert out.num_tokens <= 8
    assert chunks == [7, 7, 6]


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    sched, kv = make_sched(num_blocks=40, budget=8, chunked=False)
    sched.add_request(make_req("a", 3))
    sched.add_request(make_req("b", 8))
    out = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["a"]  # b (8) does not fit next to a (3)
    out = run_step(sched)
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1)]


def test_preemption_takes_the_most_recently_admitted_and_recomputes():
    sched, kv = make_sched(num_blocks=7, budget=64)  # 6 usable blocks
    a, b = make_req("a", 8), make_req("b", 8)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)  # a: blocks 1,2 ; b: blocks 3,4 ; both get a token (9 tokens each)
    assert kv.block_ids("a") == [1, 2] and kv.block_ids("b") == [3, 4]
    run_step(sched)  # both need a third block: a gets 5, b gets 6
    assert kv.block_ids("a") == [1, 2, 5] and kv.block_ids("b") == [3, 4, 6]
    for _ in range(3):
        run_step(sched)  # 13 tokens each... a needs a 4th block
    out = sched.schedule()
    assert [r.request_id for r in out.preempted] == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert kv.block_ids("b") == [] and [s.request.request_id for s in out.scheduled] == ["a"]
    assert sched.num_preemptions == 1
    with pytest.raises(InvalidTransition):
        b.set_status(RequestStatus.RUNNING)  # PREEMPTED must go through WAITING


def test_priority_policy_admits_lowest_value_first_and_preempts_lowest_priority():
    sched, kv = make_sched(num_blocks=7, budget=64, policy="priority")
    low = make_req("low", 8, priority=5, arrival=1.0)
    high = make_req("high", 8, priority=0, arrival=2.0)
    sched.add_request(low)
    sched.add_request(high)
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["high", "low"]
    sched.update_from_output(out, {"high": [7], "low": [7]})
    for _ in range(5):  # the 5th step needs a 4th block each: only one can have it
        out = run_step(sched)
    assert [r.request_id for r in out.preempted] == ["low"]
    assert low.num_preemptions == 1 and high.num_preemptions == 0


def test_abort_frees_everything_at_once_and_bounded_queue_rejects():
    sched, kv = make_sched(queue=1)
    r = make_req("a", 9)
    sched.add_request(r)
    with pytest.raises(QueueFullError, match="overloaded"):
        sched.add_request(make_req("b", 3))
    run_step(sched)
    assert kv.block_ids("a") == [1, 2, 3]
    sched.abort_request("a")
    assert r.status == RequestStatus.FINISHED_ABORTED and r.status.finish_reason == "abort"
    assert kv.all_free() and not sched.has_unfinished()
    with pytest.raises(InvalidTransition):
        r.set_status(RequestStatus.RUNNING)  # a finished request stays finished


def test_bounded_queue_counts_only_requests_never_admitted():
    """A request preempted back into the waiting queue (or a beam parked there while its group chooses) was
    admitted once: max_queue_size bounds new requests, so it does not take a new one's place."""
    sched, kv = make_sched(num_blocks=7, budget=64, queue=1)  # 6 usable blocks
    a, b = make_req("a", 8), make_req("b", 8)
    sched.add_request(a)
    run_step(sched)
    sched.add_request(b)
    for _ in range(6):
        run_step(sched)
    assert b.status == RequestStatus.PREEMPTED and len(sched.waiting) == 1
    sched.add_request(make_req("c", 3))  # the queue holds b, preempted: c is the only new one
    with pytest.raises(QueueFullError, match="overloaded: 1 requests waiting"):
        sched.add_request(make_req("d", 3))


def test_prefix_hits_share_blocks_by_ref_count():
    sched, kv = make_sched(num_blocks=20)
    shared = [100 + i for i in range(9)]
    a = make_req("a", 0, tokens=shared + [1])
    sched.add_request(a)
    run_step(sched)
    assert kv.block_ids("a") == [1, 2, 3]
    b = make_req("b", 0, tokens=shared + [2, 3])
    sched.add_request(b)
    out = run_step(sched)
    # b reuses a's two full blocks; only its 3 remaining tokens are computed
    assert kv.block_ids("b")[:2] == [1, 2] and b.num_cached_tokens == 8
    assert {s.request.request_id: s.num_tokens for s in out.scheduled}["b"] == 3
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [2, 2, 1]
    sched.finish_request(a, RequestStatus.FINISHED_STOPPED)
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [1, 1, 0]
    sched.finish_request(b, RequestStatus.FINISHED_STOPPED)
    assert kv.all_free()


def test_a_fully_cached_prompt_still_computes_its_last_token():
    sched, kv = make_sched(num_blocks=20)
    toks = [100 + i for i in range(8)]
    sched.add_request(make_req("a", 0, tokens=toks))
    run_step(sched)
    run_step(sched)  # 9 tokens computed -> both prompt blocks indexed
    b = make_req("b", 0, tokens=toks)
    sched.add_request(b)
    out = run_step(sched)
    assert b.num_cached_tokens == 4  # one block of two: the last prompt token must produce logits
    assert {s.request.request_id: s.num_tokens for s in out.scheduled}["b"] == 4


def run_to_completion(sched):
    """Step until every request has its max_tokens (each step's token 7); the most that ran at once."""
    most_running = 0
    while sched.has_unfinished():
        run_step(sched)
        most_running = max(most_running, len(sched.running))
        for r in list(sched.running):
            if r.num_output_tokens >= r.max_tokens:
                sched.finish_request(r, RequestStatus.FINISHED_LENGTH)
    return most_running


@pytest.mark.parametrize("capacity", ["max_utilization", "guaranteed_no_evict"])
def test_guaranteed_no_evict_admits_only_what_can_finish_without_preemption(capacity):
    # 12 usable blocks; 4 requests of 6 prompt + 10 output tokens = 4 blocks each at their longest (16 in all)
    sched, kv = make_sched(capacity=capacity)
    reqs = [make_req(i, 6, tokens=[100 + 10 * i + j for j in range(6)], max_tokens=10) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    most_running = run_to_completion(sched)
    assert all(r.output_token_ids == [7] * 10 for r in reqs)
    if capacity == "max_utilization":  # all four admitted on their prompts' 2 blocks, then outgrow the pool
        assert most_running == 4 and sched.num_preemptions > 0
    else:  # three whole sequences fit; the fourth waits for one to finish
        assert most_running == 3 and sched.num_preemptions == 0
    assert kv.all_free()


def test_guaranteed_no_evict_counts_prefix_blocks_held_by_running_requests_once():
    # 8 usable blocks. A: 16 prompt tokens (4 blocks) + 8 out = 6 blocks at its longest, 2 still to come.
    # B shares A's 16 tokens plus one: 6 blocks at its longest, 4 of them A's, so it needs 2 of the 2 left.
    sched, kv = make_sched(num_blocks=9, capacity="guaranteed_no_evict")
    prefix = [100 + j for j in range(16)]
    a = make_req("a", 16, tokens=prefix, max_tokens=8)
    sched.add_request(a)
    run_step(sched)  # A prefilled: its 4 full blocks are cached
    b = make_req("b", 17, tokens=prefix + [999], max_tokens=7)
    sched.add_request(b)
    out = run_step(sched)
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("b", 1)]
    assert kv.block_ids("b")[:4] == kv.block_ids("a")[:4]
    run_to_completion(sched)
    assert sched.num_preemptions == 0 and len(a.output_token_ids) == 8 and len(b.output_token_ids) == 7
    assert kv.all_free()


def test_guaranteed_no_evict_counts_cached_blocks_in_the_free_queue_as_taken():
    # 9 usable blocks. A (16 tokens) finishes: its 4 full blocks stay cached in the free queue.
    sched, kv = make_sched(num_blocks=10, capacity="guaranteed_no_evict")
    prefix = [100 + j for j in range(16)]
    a = make_req("a", 16, tokens=prefix, max_tokens=1)
    sched.add_request(a)
    run_to_completion(sched)
    c = make_req("c", 8, tokens=[500 + j for j in range(8)], max_tokens=8)  # 2 blocks held, 2 still to come
    sched.add_request(c)
    run_step(sched)
    # B: 6 blocks at its longest, 4 of them A's cached ones, which leave the free queue when B takes them:
    # 7 free - 2 reserved for C = 5 < 6, so B waits for C.
    b = make_req("b", 17, tokens=prefix + [999], max_tokens=7)
    sched.add_request(b)
    out = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["c"] and b.status == RequestStatus.WAITING
    run_to_completion(sched)
    assert sched.num_preemptions == 0 and len(b.output_token_ids) == 7 and kv.all_free()


def test_guaranteed_no_evict_holds_a_preempted_request_to_the_reservation():
    # 12 usable blocks, priority policy. Low (8 + 12 tokens: 5 blocks at its longest) runs; High (8 + 32: 10
    # blocks) outranks it and takes its place. High's reservation (8 more blocks) leaves no room for Low's whole
    # sequence, so Low waits for High instead of coming back to be preempted again by High's growth.
    sched, kv = make_sched(policy="priority", capacity="guaranteed_no_evict")
    low = make_req("low", 8, priority=1, max_tokens=12)
    sched.add_request(low)
    run_step(sched)
    high = make_req("high", 8, priority=0, tokens=[300 + j for j in range(8)], max_tokens=32)
    sched.add_request(high)
    out = run_step(sched)
    assert [r.request_id for r in out.preempted] == ["low"] and [s.request.request_id for s in out.scheduled] == \
        ["high"]
    assert [s.request.request_id for s in run_step(sched).scheduled] == ["high"]
    assert low.status == RequestStatus.PREEMPTED
    run_to_completion(sched)
    assert sched.num_preemptions == 1
    assert len(high.output_token_ids) == 32 and len(low.output_token_ids) == 12 and kv.all_free()


def test_guaranteed_no_evict_admits_a_request_longer_than_the_pool_when_nothing_runs():
    # 12 usable blocks; 8 + 100 tokens would take 27. Admitted when nothing runs, and nothing joins it.
    sched, _ = make_sched(capacity="guaranteed_no_evict")
    big, small = make_req("big", 8, max_tokens=100), make_req("small", 4, max_tokens=2)
    sched.add_request(big)
    sched.add_request(small)
    out = run_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["big"]
    assert small.status == RequestStatus.WAITING


def test_capacity_scheduler_policy_is_checked():
    with pytest.raises(ValueError, match="capacity_scheduler_policy"):
        SchedulerConfig(capacity_scheduler_policy="no_evict")
