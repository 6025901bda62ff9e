"""Tensor parallelism: communication per step, measured against theory, and TP=1 vs TP=N throughput.

Theory for one step of T tokens on a model of L layers, hidden size H, vocabulary V, element size e, N ranks,
R logit rows: all-reduce payload = (2L + 1) x T x H x e (one after attention and one after the MLP of every
layer, plus the vocabulary-parallel embedding), all-gather = R x ceil(V/N) x e per rank (the logits). Each
rank's wire traffic for a ring all-reduce is 2(N-1)/N of the payload. On CPU the point is correctness and
traffic, not speed (the ranks share the same cores).

    .venv/bin/python perf/tensor_parallel.py [--quick] [--tp 2] [--device cpu|cuda] [--size small|1b]
"""

from __future__ import annotations

import argparse
import time

from common import emit, model_dir, random_workload
from pagedllm import LLM, SamplingParams
from pagedllm.distributed.comm import CommStats


class StepRecorder:
    """Wraps the executor's execute_step: per step, tokens, logit rows and the bytes the collectives moved."""

    def __init__(self, executor) -> None:
        self.steps: list[dict] = []
        inner = executor.execute_step
        group = getattr(executor, "group", None)  # TP=1 runs in process: no collectives at all
        stats = group.stats if group is not None else CommStats()

        def execute_step(step):
            before = dict(vars(stats))
            logits = inner(step)
            after = vars(stats)
            self.steps.append({"tokens": len(step.input_ids), "rows": len(step.logits_indices),
                               "decode_only": step.num_decodes == len(step.seq_lens),
                               **{k: after[k] - before[k] for k in after}})
            return logits

        executor.execute_step = execute_step


def run(path, tp, device, prompts, params):
    llm = LLM(path, dtype=path.rsplit("-", 1)[1], tensor_parallel_size=tp, device=device, max_model_len=1024,
              kv_cache_memory_bytes=256 << 20, max_num_batched_tokens=1024)
    recorder = StepRecorder(llm.engine.executor)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], SamplingParams(max_tokens=2), use_tqdm=False)
    recorder.steps.clear()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    cfg = llm.engine.model_info.hf_config
    llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], elapsed, recorder.steps, cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="float32 output is token-identical to TP=1; bf16 rounds the partial sums differently, "
                         "which can flip near-ties")
    ap.add_argument("--size", default="small", choices=["tiny", "small", "125m", "1b"])
    args = ap.parse_args()
    size = "tiny" if args.quick else args.size
    path = model_dir("llama", size, args.dtype)
    n, out_len = (8, 16) if args.quick else (32, 64)
    prompts = random_workload(n, 32, 256, 2048 if args.quick else 32000, seed=11)
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)

    ref, t1, _, cfg = run(path, 1, args.device, prompts, params)
    got, tn, steps, _ = run(path, args.tp, args.device, prompts, params)
    elem = 2 if args.dtype == "bfloat16" else 4
    per_rank_vocab = -(-cfg.vocab_size // args.tp)
    tokens = sum(len(t) for t in got)
    for kind in ("prefill or mixed", "decode only"):
        chosen = [s for s in steps if s["decode_only"] == (kind == "decode only")]
        if not chosen:
            continue
        t = sum(s["tokens"] for s in chosen)
        r = sum(s["rows"] for s in chosen)
        reduce_theory = (2 * cfg.num_hidden_layers + 1) * t * cfg.hidden_size * elem
        gather_theory = r * per_rank_vocab * elem
        measured_reduce = sum(s["all_reduce_bytes"] for s in chosen)
        measured_gather = sum(s["all_gather_bytes"] for s in chosen)
        emit({"bench": "tp_comm", "tp": args.tp, "steps": kind, "num_steps": len(chosen), "tokens": t,
              "all_reduce_calls_per_step": sum(s["all_reduce_calls"] for s in chosen) / len(chosen),
              "all_reduce_bytes": measured_reduce, "all_reduce_bytes_theory": reduce_theory,
              "all_reduce_ratio": round(measured_reduce / reduce_theory, 4),
              "all_gather_bytes": measured_gather, "all_gather_bytes_theory": gather_theory,
              "all_gather_ratio": round(measured_gather / gather_theory, 4) if gather_theory else None,
              "all_reduce_bytes_per_token": measured_reduce / t,
              "ring_wire_bytes_per_rank": round(measured_reduce * 2 * (args.tp - 1) / args.tp)})
    emit({"bench": "tp_throughput", "model": size, "device": args.device, "tp": args.tp,
          "dtype": args.dtype, "identical_sequences": f"{sum(a == b for a, b in zip(got, ref))}/{len(ref)}",
          "tokens": tokens,
          "tp1_tok_s": round(tokens / t1, 1), f"tp{args.tp}_tok_s": round(tokens / tn, 1),
          "ratio": round(t1 / tn, 3)})


if __name__ == "__main__":
    main()
