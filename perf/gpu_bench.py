"""GPU benchmarks (run by perf/gpu_check.sh on a CUDA machine): HBM bandwidth, paged decode attention vs
torch SDPA on contiguous KV (same lengths) in GB/s, and end-to-end decode of a ~1B random Llama at batch
1, 8, 64 against the weights-bandwidth roofline, with decode CUDA graphs and without (enforce_eager). One JSON
line per result."""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit  # noqa: E402


def bench(fn, iters=20) -> float:
    """Median seconds of fn() (CUDA-synchronised)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def hbm_peak() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 4 GiB as int32 below
    a = a.view(torch.int32)
    b = torch.empty_like(a)
    t = bench(lambda: b.copy_(a))
    return 2 * a.numel() * 4 / t  # bytes read + written


def attention_bench(peak: float) -> None:
    from pagedllm_kernels.paged_attention import paged_attention

    for batch, ctx in ((64, 4096), (16, 16384), (128, 1024)):
        heads, kv_heads, d, bs = 32, 8, 128, 16
        nb = ctx // bs
        k_cache = torch.randn(batch * nb + 1, bs, kv_heads, d, device="cuda", dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        tables = (torch.randperm(batch * nb, device="cuda") + 1).view(batch, nb).int()
        q = torch.randn(batch, heads, d, device="cuda", dtype=torch.bfloat16)
        seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        t_paged = bench(lambda: paged_attention(q, k_cache, v_cache, tables, seq_lens, qsl, 1, d ** -0.5))
        k = torch.randn(batch, kv_heads, ctx, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        qc = q.view(batch, heads, 1, d)
        t_sdpa = bench(lambda: F.scaled_dot_product_attention(qc, k, v, enable_gqa=True))
        kv_bytes = 2 * batch * ctx * kv_heads * d * 2
        emit({"bench": "decode_attention", "batch": batch, "context": ctx, "paged_ms": round(1000 * t_paged, 3),
              "sdpa_contiguous_ms": round(1000 * t_sdpa, 3), "paged_GBps": round(kv_bytes / t_paged / 1e9, 1),
              "sdpa_GBps": round(kv_bytes / t_sdpa / 1e9, 1), "paged_fraction_of_hbm": round(kv_bytes / t_paged / peak, 3)})


def decode_bench(peak: float) -> None:
    """Decode with the CUDA-graph buckets (the default) and with enforce_eager, one engine after the other."""
    from pagedllm import LLM, SamplingParams
    from pagedllm.tiny_model import make_tiny_model

    path = os.path.join(tempfile.gettempdir(), "pagedllm-1b")
    if not os.path.exists(os.path.join(path, "config.json")):
        make_tiny_model(path, arch="llama", size="1b", dtype="bfloat16")
    for eager in (False, True):
        # the Triton backend in both: graphs need it, and auto might race torch in (graphs off then)
        llm = LLM(path, dtype="bfloat16", max_model_len=1024, kv_cache_memory_bytes=8 << 30, max_num_seqs=64,
                  enforce_eager=eager, attention_backend="triton")
        weights = sum(p.numel() * p.element_size() for p in llm.engine.executor.model.parameters())
        stats = llm.get_stats()
        emit({"bench": "engine", "enforce_eager": eager, "attention_backend": stats.attention_backend,
              "selection": stats.attention_selection, "decode_graphs": stats.decode_graphs,
              "weights_GB": round(weights / 1e9, 2)})
        for batch in (1, 8, 64):
            prompts = [{"prompt_token_ids": [0] + [(7 * i + j) % 31000 + 3 for j in range(127)]} for i in range(batch)]
            params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
            runs = []
            for _ in range(3):  # steady state: the median of three timed runs after the warm-up
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                torch.cuda.synchronize()
                runs.append(time.perf_counter() - t0)
            elapsed = sorted(runs)[1]
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            steps_per_s = 128 / elapsed  # one decode step per token of each request
            emit({"bench": "e2e_decode", "enforce_eager": eager, "batch": batch,
                  "output_tokens_per_s": round(tokens / elapsed, 1), "steps_per_s": round(steps_per_s, 1),
                  "fraction_of_weight_roofline": round(steps_per_s * weights / peak, 3)})
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("gpu_bench.py needs a CUDA device")
    peak = hbm_peak()
    emit({"bench": "hbm_copy", "device": torch.cuda.get_device_name(), "GBps": round(peak / 1e9, 1)})
    attention_bench(peak)
    decode_bench(peak)


if __name__ == "__main__":
    main()
