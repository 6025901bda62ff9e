"""GPU benchmarks (run by perf/gpu_check.sh on a CUDA machine): HBM bandwidth, paged decode attention vs
torch SDPA on contiguous KV (same lengths) in GB/s, and end-to-end decode of a ~1B random Llama at batch
1, 8, 64 against the weights-bandwidth roofline: bf16 with decode CUDA graphs and without (enforce_eager), with
an fp8 KV cache, fp8 W8A8 weights (tensor cores) and int4 AWQ weights; where a batch-1 step's time goes. One
JSON line per result."""

from __future__ import annotations

import gc
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import emit, model_dir  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402


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


VARIANTS = (  # label, checkpoint (dense bf16, or quantized from it: perf/common.quantized_model_dir), engine options
    ("bf16", "dense", {}),
    ("bf16 eager", "dense", {"enforce_eager": True}),
    ("bf16 + fp8 KV", "dense", {"kv_cache_dtype": "fp8"}),
    ("fp8 W8A8 (channel, dynamic per token)", "fp8", {}),
    ("int4 AWQ g128", "awq", {}),
)


def decode_bench(peak: float, out_dir: str) -> None:
    """Decode at batch 1, 8 and 64 (128-token prompts, 128 greedy tokens, the median of three timed runs after a
    warm-up) for each variant of a ~1B random Llama, one engine after the other, against the roofline of reading
    each variant's weights once per step."""
    from common import quantized_model_dir

    for label, checkpoint, options in VARIANTS:
        path = model_dir("llama", "1b") if checkpoint == "dense" else quantized_model_dir("llama", "1b", checkpoint)
        t0 = time.perf_counter()
        # the Triton backend throughout: graphs need it, and auto might race torch in (graphs off then)
        llm = LLM(path, dtype="bfloat16", max_model_len=1024, kv_cache_memory_bytes=8 << 30, max_num_seqs=64,
                  attention_backend="triton", **options)
        model = llm.engine.executor.model
        weights = bytes_read_per_step(model)
        stats = llm.get_stats()
        emit({"bench": "engine", "variant": label, "start_s": round(time.perf_counter() - t0, 1),
              "attention_backend": stats.attention_backend, "decode_graphs": stats.decode_graphs,
              "weights_GB": round(weights / 1e9, 3),
              "cpu_kernels_loaded": "pagedllm_kernels.cpu.build" in sys.modules})
        for batch in (1, 8, 64):
            prompts = [{"prompt_token_ids": [0] + [(7 * i + j) % 31000 + 3 for j in range(127)]} for i in range(batch)]
            params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
            runs = []
            for _ in range(4):  # steady state: the median of the last three timed runs
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                torch.cuda.synchronize()
                runs.append(time.perf_counter() - t0)
            elapsed = sorted(runs[1:])[1]
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            steps_per_s = 128 / elapsed  # one decode step per token of each request (the prefill step included)
            emit({"bench": "e2e_decode", "variant": label, "batch": batch, "runs_s": [round(r, 3) for r in runs],
                  "output_tokens_per_s": round(tokens / elapsed, 1), "step_ms": round(1000 / steps_per_s, 3),
                  "fraction_of_weight_roofline": round(steps_per_s * weights / peak, 3)})
            if batch == 1 and label == "bf16":
                step_anatomy(llm, prompts, params, elapsed / 128, weights, peak, out_dir)
        del llm, model
        gc.collect()
        torch.cuda.empty_cache()


def bytes_read_per_step(model: torch.nn.Module) -> int:
    """The bytes a decode step must read once whatever the batch: every parameter and buffer (quantized layers
    keep their weights as buffers), less the embedding table, of which a step reads only its tokens' rows
    (unless the LM head shares it)."""
    head = getattr(model, "lm_head", None)
    head_weight = getattr(head, "weight", None)
    gathered = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)
                and m.weight is not head_weight}
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if id(t) not in gathered}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def step_anatomy(llm, prompts, params, step_s: float, weights: int, peak: float, out_dir: str) -> None:
    """Where a batch-1 decode step's time goes: the graph replay alone (the forward pass on the GPU) against the
    whole step, and a cProfile of one generate call (written to out_dir/decode_profile.txt)."""
    import cProfile
    import io
    import pstats

    graphs = getattr(llm.engine.executor.worker.runner, "graphs", None)
    if graphs is not None and 1 in graphs.graphs:
        replay_s = bench(graphs.graphs[1].replay, iters=200)
        emit({"bench": "batch1_step_anatomy", "step_ms": round(1000 * step_s, 3),
              "graph_replay_ms": round(1000 * replay_s, 3), "host_and_head_ms": round(1000 * (step_s - replay_s), 3),
              "replay_fraction_of_weight_roofline": round(weights / replay_s / peak, 3)})
    profile = cProfile.Profile()
    profile.enable()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    with open(os.path.join(out_dir, "decode_profile.txt"), "w") as f:
        f.write(text.getvalue())
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:12]  # by total time in the function itself
    emit({"bench": "batch1_profile_top", "per_step_us": {f"{os.path.basename(k[0])}:{k[2]}": round(1e6 * v[2] / 128, 1)
                                                         for k, v in rows}})


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("gpu_bench.py needs a CUDA device")
    out_dir = os.environ.get("OUT", os.path.join(os.path.dirname(os.path.abspath(__file__)), "out"))
    os.makedirs(out_dir, exist_ok=True)
    peak = hbm_peak()
    emit({"bench": "hbm_copy", "device": torch.cuda.get_device_name(), "GBps": round(peak / 1e9, 1)})
    attention_bench(peak)
    decode_bench(peak, out_dir)


if __name__ == "__main__":
    main()
