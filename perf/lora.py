"""Multi-LoRA throughput: the W-medium workload (64 random prompts of 32-256 tokens, 128 greedy tokens each,
125M Llama, bf16) with its requests spread round robin over 4 rank-16 adapters on all seven projections,
side by side with the same workload on the base model alone (an engine without LoRA), in one process,
interleaved over several rounds after a full warm-up pass of each. With --with-vllm, vLLM's CPU build runs the
same two workloads with the same adapters, in its documented CPU setup (perf/vllm_lora.py), and the ratio of
the two engines' LoRA tokens/s (medians of the rounds) is printed too.

    .venv/bin/python perf/lora.py [--quick] [--size 125m] [--rounds 3] [--with-vllm]
    .venv/bin/python perf/lora.py --deltas   # the LoRA deltas of one 125M decode step, C++ kernel vs torch

--deltas times the 48 LoRA modules of a 125M decode step (64 tokens over 4 rank-16 adapters, bf16, each module
its own weights) through the C++ kernel and through the grouped-bmm torch path.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from common import OUT_DIR, emit, model_dir, random_workload
from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.tiny_model import make_lora_adapter


def adapters(path: str, size: str, count: int, rank: int) -> list[LoRARequest]:
    out = []
    for i in range(count):
        d = os.path.join(OUT_DIR, "loras", f"llama-{size}-r{rank}-{i}")
        if not os.path.exists(os.path.join(d, "adapter_config.json")):
            make_lora_adapter(path, d, rank=rank, seed=100 + i)
        out.append(LoRARequest(f"adapter{i}", i + 1, d))
    return out


def timed(llm, prompts, params, loras) -> tuple[float, int]:
    llm.reset_prefix_cache()  # every pass prefills its prompts: no round reuses the one before
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def delta_bench(tokens: int = 64, slots: int = 4, rank: int = 16) -> None:
    import numpy as np
    import torch
    from pagedllm_kernels.cpu import lora as kernel

    from pagedllm.models.lora.layers import LoRABatch, LoRALinear, LoRAState

    state = LoRAState()
    state.tokens = LoRABatch(np.arange(tokens) % slots, "cpu", torch.bfloat16)
    shapes = [(768, [768, 256, 256]), (768, [768]), (768, [2048, 2048]), (2048, [768])] * 12  # qkv, o, gate_up, down
    modules = []
    for k, outs in shapes:
        base = torch.nn.Linear(k, sum(outs), bias=False).to(torch.bfloat16)
        layer = LoRALinear(base, [(f"p{i}", 0, n) for i, n in enumerate(outs)], (0, k), state, slots, rank)
        for slot in range(slots):
            layer.set_slot(slot, [(torch.randn(rank, k) * 0.05, torch.randn(n, rank) * 0.05) for n in outs])
        modules.append((layer, torch.randn(tokens, k, dtype=torch.bfloat16), torch.zeros(tokens, sum(outs),
                                                                                          dtype=torch.bfloat16)))
    times = {}
    for name, use in (("torch", None), ("cpp", kernel), ("torch", None), ("cpp", kernel)):
        for layer, _, _ in modules:
            layer.kernel = use
        step = lambda: [state.tokens.add_delta(y, x, layer) for layer, x, y in modules]  # noqa: E731
        step()
        t0 = time.perf_counter()
        for _ in range(20):
            step()
        times.setdefault(name, []).append((time.perf_counter() - t0) / 20 * 1e3)
    emit({"metric": "lora_deltas_ms_per_decode_step", "tokens": tokens, "adapters": slots, "rank": rank,
          "torch_ms": round(min(times["torch"]), 2), "cpp_ms": round(min(times["cpp"]), 2),
          "speedup": round(min(times["torch"]) / min(times["cpp"]), 2)})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--size", default="125m")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--with-vllm", action="store_true")
    ap.add_argument("--deltas", action="store_true", help="only the per-step LoRA delta micro-benchmark")
    args = ap.parse_args()
    if args.deltas:
        delta_bench()
        return
    size, n, max_tokens, rounds = ("tiny", 16, 32, 1) if args.quick else (args.size, 64, 128, args.rounds)
    path = model_dir("llama", size, "bfloat16")
    loras = adapters(path, size, args.adapters, args.rank)
    prompts = random_workload(n, 32, 256, 2000, seed=0)
    spread = [loras[i % len(loras)] for i in range(n)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    common = dict(dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=1 << 30, max_num_seqs=256)
    base = LLM(path, **common)
    lora = LLM(path, enable_lora=True, max_loras=len(loras), max_lora_rank=args.rank, **common)
    for llm, ls in ((base, None), (lora, spread)):  # a full pass: steady state from the first timed round
        timed(llm, prompts, params, ls)
    ratios, lora_tok_s = [], []
    for r in range(rounds):
        tb, nb = timed(base, prompts, params, None)
        tl, nl = timed(lora, prompts, params, spread)
        ratios.append((nl / tl) / (nb / tb))
        lora_tok_s.append(nl / tl)
        emit({"engine": "pagedllm", "model": f"llama-{size}", "round": r + 1, "base_tok_s": round(nb / tb, 1),
              "lora_tok_s": round(nl / tl, 1), "ratio_lora_over_base": round(ratios[-1], 3)})
    summary = {"engine": "pagedllm", "model": f"llama-{size}", "adapters": len(loras), "rank": args.rank,
               "prompts": n, "max_tokens": max_tokens, "ratio_per_round": [round(x, 3) for x in ratios],
               "ratio_median": round(statistics.median(ratios), 3)}
    emit(summary)
    if args.with_vllm:
        from vllm_lora import run_vllm_lora

        base.shutdown()
        lora.shutdown()
        del base, lora
        peer = run_vllm_lora(path, prompts, max_tokens, loras, args.rank, rounds)
        for line in peer:
            emit(line)
        lora_rounds = [line["lora_tok_s"] for line in peer if "lora_tok_s" in line]
        if lora_rounds:
            emit({"model": f"llama-{size}", "ratio_pagedllm_lora_over_vllm_lora": round(
                statistics.median(lora_tok_s) / statistics.median(lora_rounds), 3)})


if __name__ == "__main__":
    main()
