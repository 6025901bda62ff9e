"""What preemption by recompute costs a KV-bound offline cell, per capacity scheduler policy: the scheduler and KV
cache manager alone (ours, no model: every scheduled row gets a token), on a grid cell's prompt lengths, run to
the end. Prints the prompt and output tokens computed against those the cell needs (a recomputed prefill counts
again), the preemptions, the steps and the most requests running at once; then each policy's tokens as a ratio
to max_utilization's. A prediction of the work, not a timing: perf/throughput.py times it.

    .venv/bin/python perf/preemption_waste.py [--kv-gib 4] [--prompts long] [--outputs 512] [--seqs 256]
        [--kv-bytes-per-token 12288]       # 125M and 0.5B (bf16) both store 12,288 bytes a token
"""

from __future__ import annotations

import argparse

from common import emit, random_workload
from offline_worker import MAX_MODEL_LEN, MAX_NUM_SEQS
from pagedllm.config import CAPACITY_POLICIES, SchedulerConfig
from pagedllm.engine.kv_cache_manager import KVCacheManager
from pagedllm.engine.request import Request, RequestStatus
from pagedllm.engine.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams
from throughput import PROMPTS

BLOCK_SIZE = 16


def simulate(policy: str, prompts: list[list[int]], max_tokens: int, num_blocks: int) -> dict:
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, capacity_scheduler_policy=policy), kv,
                      max_model_len=MAX_MODEL_LEN)
    for i, ids in enumerate(prompts):
        sched.add_request(Request(str(i), ids, SamplingParams(temperature=0), frozenset(), BLOCK_SIZE,
                                  max_tokens=max_tokens))
    steps = computed = most_running = 0
    while sched.has_unfinished():
        out = sched.schedule()
        steps += 1
        computed += out.num_tokens
        most_running = max(most_running, len(sched.running))
        for req in sched.update_from_output(out, {s.request.request_id: [3] for s in out.scheduled}):
            if req.num_output_tokens >= max_tokens:
                sched.finish_request(req, RequestStatus.FINISHED_LENGTH)
    assert kv.all_free()
    return {"policy": policy, "tokens_computed": computed, "preemptions": sched.num_preemptions, "steps": steps,
            "most_running": most_running}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-gib", type=float, default=4)
    ap.add_argument("--kv-bytes-per-token", type=int, default=12288)
    ap.add_argument("--prompts", default="long", choices=sorted(PROMPTS))
    ap.add_argument("--outputs", type=int, default=512)
    ap.add_argument("--seqs", type=int, default=256)
    args = ap.parse_args()
    num_blocks = int(args.kv_gib * (1 << 30)) // (args.kv_bytes_per_token * BLOCK_SIZE)
    prompts = random_workload(args.seqs, *PROMPTS[args.prompts], 32000)
    # every prompt token once, and every output token but the last (sampled, never fed back)
    needed = sum(len(p) + args.outputs - 1 for p in prompts)
    cell = {"prompts": args.prompts, "output_tokens": args.outputs, "seqs": args.seqs, "kv_blocks": num_blocks,
            "tokens_needed": needed}
    rows = [simulate(policy, prompts, args.outputs, num_blocks) for policy in CAPACITY_POLICIES]
    for row in rows:
        emit({**cell, **row, "computed_over_needed": round(row["tokens_computed"] / needed, 3)})
    emit({**cell, "tokens_over_max_utilization": {r["policy"]: round(r["tokens_computed"]
                                                                       / rows[0]["tokens_computed"], 3)
                                                  for r in rows}})


if __name__ == "__main__":
    main()
