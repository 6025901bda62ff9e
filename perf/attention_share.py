"""Attention on CPU, per backend, in one run:
- the share of a decode step spent in attention (every layer's KV store and attention kernel) on the 125M
  workload of perf/throughput.py, with the resulting decode tokens/s. Where the C++ decoder loop runs the step
  (the cpu backend), the loop times its own stores and kernel calls, and its linears too (linear_ms; other_ms is
  the rest of the step: norms, rotary, activation, the LM head, sampling, the scheduler); elsewhere each layer's
  backend.forward is timed from Python. Each (backend, cache dtype) gets --rounds fresh engines, taken
  in turn so that the host's drift falls on all of them alike; every round is printed, then the medians;
- one prefill row of L tokens (125M attention shapes) through each backend;
each with the bf16 cache and the fp8 one (--kv-cache-dtypes), and fp8's ratios to bf16.

    .venv/bin/python perf/attention_share.py [--quick] [--backends torch,cpu] [--kv-cache-dtypes auto,fp8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import emit, model_dir, random_workload
from pagedllm import LLM, SamplingParams


class AttentionTimer:
    """Wraps a backend's forward and adds up the wall time spent in it."""

    def __init__(self, backend) -> None:
        self.seconds = 0.0
        inner = backend.forward

        def forward(*args, **kwargs):
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            self.seconds += time.perf_counter() - t0
            return out

        backend.forward = forward


def measure_steps(path, backend, prompts, steps, kv_cache_dtype):
    """One fresh engine: its prompts prefilled, a few decode steps, then `steps` timed decode steps."""
    llm = LLM(path, dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=2 << 30, max_num_seqs=256,
              attention_backend=backend, kv_cache_dtype=kv_cache_dtype)
    engine = llm.engine
    for p in prompts:
        engine.add_request({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or \
            engine.scheduler.waiting:
        engine.step()  # prefills done: from here on every step decodes every request
    for _ in range(5):
        engine.step()
    loop = getattr(engine.executor.model.model, "decoder_loop", None)
    attention_before = loop.attention_seconds if loop is not None else 0.0
    linears_before = loop.linear_seconds if loop is not None else 0.0
    timer = AttentionTimer(engine.backend)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    total = time.perf_counter() - t0
    attention = timer.seconds + (loop.attention_seconds - attention_before if loop is not None else 0.0)
    linears = loop.linear_seconds - linears_before if loop is not None else None
    rows = len(engine.scheduler.running)
    llm.shutdown()
    split = {} if linears is None else {"linear_ms": round(1000 * linears / steps, 2),
                                        "other_ms": round(1000 * (total - attention - linears) / steps, 2)}
    return {"bench": "attention_share", "backend": engine.backend.name, "kv_cache_dtype": kv_cache_dtype,
            "decode_rows": rows, "timed_in_decoder_loop": loop is not None and timer.seconds == 0.0,
            "step_ms": round(1000 * total / steps, 2), "attention_ms": round(1000 * attention / steps, 2), **split,
            "attention_share": round(attention / total, 3), "decode_tok_s": round(rows * steps / total, 1)}


def medians(rounds: list[dict]) -> dict:
    return {**{k: rounds[0][k] for k in ("backend", "kv_cache_dtype", "decode_rows")}, "bench": "attention_share_median",
            "rounds": len(rounds),
            **{k: round(statistics.median(r[k] for r in rounds), 3)
               for k in ("step_ms", "attention_ms", "linear_ms", "other_ms", "attention_share", "decode_tok_s")
               if k in rounds[0]}}


def prefill_row_ms(backend_name: str, length: int, kv_cache_dtype: str, repeats: int = 3) -> float:
    """One layer's attention over a fresh L-token prompt (12 heads, 4 KV heads, head_dim 64, bf16)."""
    import torch
    from pagedllm.attention.metadata import AttentionMetadata
    from pagedllm.attention.selector import BUILDERS

    backend = BUILDERS[backend_name]()
    if hasattr(backend, "warm_up"):
        backend.warm_up("cpu")
    bs, blocks = 16, -(-length // 16)
    cache = torch.zeros(2, blocks + 1, bs, 4, 64,
                        dtype=torch.float8_e4m3fn if kv_cache_dtype == "fp8" else torch.bfloat16)
    q = torch.randn(length, 12, 64).to(torch.bfloat16)
    k, v = (torch.randn(length, 4, 64).to(torch.bfloat16) for _ in range(2))
    table = (torch.randperm(blocks) + 1)[None]
    pos = torch.arange(length)
    meta = AttentionMetadata(
        slot_mapping=table[0, pos // bs] * bs + pos % bs, block_tables=table, seq_lens=torch.tensor([length]),
        query_start_loc=[0, length], query_start_loc_t=torch.tensor([0, length], dtype=torch.int32),
        max_query_len=length, seq_lens_list=[length], num_decodes=0, block_size=bs, backend=backend)
    with torch.inference_mode():
        backend.forward(q, k, v, cache, meta, 0.125, None)
        t0 = time.perf_counter()
        for _ in range(repeats):
            backend.forward(q, k, v, cache, meta, 0.125, None)
    return 1000 * (time.perf_counter() - t0) / repeats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--backends", default="torch,cpu")
    ap.add_argument("--kv-cache-dtypes", default="auto,fp8", help="auto = the model's bf16")
    ap.add_argument("--rounds", type=int, default=3, help="fresh engines per (backend, cache dtype), taken in turn")
    args = ap.parse_args()
    size = "small" if args.quick else "125m"
    path = model_dir("llama", size, "bfloat16")
    prompts = random_workload(16 if args.quick else 64, 32, 256, 32000, seed=0)
    backends, kv_dtypes = args.backends.split(","), args.kv_cache_dtypes.split(",")
    cells = [(b, kv) for kv in kv_dtypes for b in backends]
    rounds = {cell: [] for cell in cells}
    for _ in range(1 if args.quick else args.rounds):
        for b, kv in cells:
            rounds[b, kv].append(measure_steps(path, b, prompts, 5 if args.quick else 40, kv))
            emit(rounds[b, kv][-1])
    results = {cell: medians(rs) for cell, rs in rounds.items()}
    for r in results.values():
        emit(r)
    if len(backends) == 2:
        for kv in kv_dtypes:
            a, b = (results[name, kv] for name in backends)
            emit({"bench": "attention_share_ratio", "kv_cache_dtype": kv,
                  f"{b['backend']}_over_{a['backend']}_decode_tok_s": round(b["decode_tok_s"] / a["decode_tok_s"], 3)})
    if "auto" in kv_dtypes and "fp8" in kv_dtypes:
        for name in backends:
            a, b = results[name, "auto"], results[name, "fp8"]
            emit({"bench": "fp8_over_bf16_cache", "backend": name,
                  "attention_ms_ratio": round(b["attention_ms"] / a["attention_ms"], 3),
                  "decode_tok_s_ratio": round(b["decode_tok_s"] / a["decode_tok_s"], 3)})
    for length in (128, 512) if args.quick else (128, 256, 512, 1024, 2048):
        for kv in kv_dtypes:
            emit({"bench": "prefill_row_attention_ms", "tokens": length, "kv_cache_dtype": kv,
                  **{b: round(prefill_row_ms(b, length, kv), 2) for b in backends}})


if __name__ == "__main__":
    main()
