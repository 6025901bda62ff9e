"""Serving benchmark through the real tritonserver: output tokens/s, TTFT and inter-token latency (p50/p99)
at several concurrencies over gRPC streaming, and served ÷ offline throughput on the same workload.

    .venv/bin/python perf/serving.py                 # small Llama (bf16), concurrency 1, 8, 32
    .venv/bin/python perf/serving.py --quick         # tiny model, fewer requests
Raw TTFT/ITL samples go to perf/out/serving_samples.json (perf/plots.py draws them).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import threading
import time
from pathlib import Path

from common import OUT_DIR, emit, model_dir
from pagedllm import LLM, SamplingParams
from pagedllm.serving import launcher
from pagedllm_client import PagedLLMClient

ENGINE = {"dtype": "bfloat16", "max_model_len": 1024, "kv_cache_memory_bytes": 1 << 30, "max_num_seqs": 64}


def make_prompts(tokenizer, n: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    vocab = [tokenizer.decode([i]) for i in range(3, min(tokenizer.vocab_size, 5000))]
    return ["".join(rng.choice(vocab) for _ in range(words)) for _ in range(n)]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def run_level(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    ttft, itl, tokens = [], [], [0]
    lock = threading.Lock()
    queue = list(prompts)

    def worker():
        client = PagedLLMClient(url)
        while True:
            with lock:
                if not queue:
                    return
                prompt = queue.pop()
            start = last = time.perf_counter()
            first = True
            for _ in client.stream(prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0):
                now = time.perf_counter()
                with lock:
                    (ttft if first else itl).append(now - (start if first else last))
                first, last = False, now
            with lock:
                tokens[0] += max_tokens

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    samples = {"ttft_s": ttft, "itl_s": itl}
    return samples, {"concurrency": concurrency, "requests": len(prompts),
                     "output_tokens_per_s": round(tokens[0] / elapsed, 1),
            "ttft_p50_ms": round(1000 * pct(ttft, 0.5), 1), "ttft_p99_ms": round(1000 * pct(ttft, 0.99), 1),
            "itl_p50_ms": round(1000 * pct(itl, 0.5), 2), "itl_p99_ms": round(1000 * pct(itl, 0.99), 2)}


def offline_tps(path: str, prompts: list[str], max_tokens: int, max_num_seqs: int) -> float:
    """Offline throughput with the same batch width as the served level (max_num_seqs = concurrency)."""
    llm = LLM(path, **{**ENGINE, "max_num_seqs": max_num_seqs})
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:2], params, use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--size", default=None)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=None)
    args = ap.parse_args()
    size = args.size or ("tiny" if args.quick else "small")
    max_tokens = args.max_tokens or (32 if args.quick else 128)
    path = model_dir("llama", size, "bfloat16")
    levels = [int(c) for c in args.concurrency.split(",")]
    llm_tok = LLM(path, **{**ENGINE, "kv_cache_memory_bytes": 64 << 20}).get_tokenizer()
    work = Path(tempfile.mkdtemp(prefix="pagedllm-serving-"))
    server = launcher.launch_on_free_ports(work, path, ENGINE)
    proc = server.proc
    try:
        url = f"127.0.0.1:{server.grpc_port}"
        results = []
        for c in levels:
            n = max(8, 2 * c) if not args.quick else max(4, c)
            prompts = make_prompts(llm_tok, n, words=64, seed=c)
            samples, served = run_level(url, prompts, c, max_tokens)
            served.update({"engine": "pagedllm-triton", "model": f"llama-{size}", "max_tokens": max_tokens})
            emit(served)
            results.append({**served, **samples})
            if c == max(levels):
                launcher.stop_server(proc)  # free the cores for the offline run of the same workload
                off = offline_tps(path, prompts, max_tokens, c)
                emit({"engine": "pagedllm-offline", "model": f"llama-{size}", "requests": n,
                      "output_tokens_per_s": round(off, 1),
                      "served_over_offline": round(served["output_tokens_per_s"] / off, 2)})
    finally:
        launcher.stop_server(proc)
    # Raw latency samples for perf/plots.py.
    os.makedirs(OUT_DIR, exist_ok=True)
    with open(os.path.join(OUT_DIR, "serving_samples.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
