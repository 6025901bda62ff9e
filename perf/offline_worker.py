"""One engine, kept loaded, timing the cells perf/throughput.py sends it. Runs in the engine's own venv (ours,
or vLLM's with its CPU setup; both LLM classes take the same calls), so the harness can alternate engines
cell by cell and the host's drift falls on both alike.

    python offline_worker.py ENGINE MODEL DTYPE KV_GIB [OPTIONS_JSON]    (ENGINE: pagedllm | vllm)

OPTIONS_JSON: more engine arguments (e.g. {"kv_cache_dtype": "fp8"}). The ready line reports pagedllm's memory
footprint: the bytes its weights hold and one token's KV bytes.

Protocol: one JSON object per line on stdin, {"prompts": [[ids]], "max_tokens": N, "repeats": R,
"min_seconds": S, "warmup": true (the default; false: no untimed run first)}; for each, one JSON line on stdout, {"seconds": [...], "tokens": [...], "warmup_seconds": s}.
Every cell is first run once untimed (the warm-up: caches, allocator, compiled graphs reach steady state),
then at least R times and until S seconds are timed (at most 4R runs); the prefix cache is reset before every
run, so each one prefills its prompts.
"""

import json
import os
import signal
import sys
import threading
import time

MAX_MODEL_LEN = 2560  # the grid's longest prompt (2,000) plus its longest output (512), rounded up to a block
MAX_NUM_SEQS = 256  # the grid's widest cell; both engines run every cell with the same limit


def make_engine(engine: str, model: str, dtype: str, kv_gib: int, options: dict):
    if engine == "vllm":  # KV space comes from VLLM_CPU_KVCACHE_SPACE (perf/vllm_lora.py peer_env)
        from vllm import LLM, SamplingParams

        return LLM(model=model, dtype=dtype, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, seed=0,
                   **options), SamplingParams
    from pagedllm import LLM, SamplingParams

    return LLM(model, dtype=dtype, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS,
               kv_cache_memory_bytes=kv_gib << 30, **options), SamplingParams


def footprint(llm) -> dict:
    """pagedllm's weight bytes (parameters and buffers, each storage once; oneDNN's packed weights, whose storage
    is opaque, by their elements) and KV bytes per token."""
    from pagedllm.engine.kv_sizing import KVGeometry

    engine = llm.engine
    model = engine.executor.model
    seen, weight_bytes = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.is_mkldnn:
            key, nbytes = id(t), t.numel() * t.element_size()
        else:
            key, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        if key not in seen:
            seen.add(key)
            weight_bytes += nbytes
    block = engine.config.cache.block_size
    kv = KVGeometry.of(model).bytes_per_block(block, engine.model_info.kv_dtype) // block
    return {"weight_bytes": weight_bytes, "kv_bytes_per_token": kv}


def timed(llm, prompts, params) -> tuple[float, int]:
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


def die_with_the_harness() -> None:
    """Take this worker's process group (it leads its own session: vLLM's engine-core and worker processes are in
    it too) down when it is told to stop, or as soon as the harness that started it is gone, whatever killed it:
    a peer left running (vLLM's CPU worker spins on its queue) would skew every later benchmark on the host."""
    harness = os.getppid()

    def stop(*_) -> None:
        if os.getpgid(0) == os.getpid():  # never the group of whoever ran it by hand
            os.killpg(0, signal.SIGKILL)
        os._exit(1)

    def watch() -> None:
        while os.getppid() == harness:  # reparented once the harness exits
            time.sleep(0.5)
        stop()

    signal.signal(signal.SIGTERM, stop)
    threading.Thread(target=watch, name="harness-watch", daemon=True).start()


def main() -> None:
    die_with_the_harness()
    engine, model, dtype, kv_gib = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    options = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    llm, sampling_params = make_engine(engine, model, dtype, kv_gib, options)
    print(json.dumps({"ready": engine, **(footprint(llm) if engine == "pagedllm" else {})}), flush=True)
    for line in sys.stdin:
        cell = json.loads(line)
        prompts = [{"prompt_token_ids": p} for p in cell["prompts"]]
        params = sampling_params(temperature=0, max_tokens=cell["max_tokens"], ignore_eos=True)
        warmup = timed(llm, prompts, params)[0] if cell.get("warmup", True) else 0.0
        runs = []
        while len(runs) < cell["repeats"] or (sum(s for s, _ in runs) < cell["min_seconds"]
                                              and len(runs) < 4 * cell["repeats"]):
            runs.append(timed(llm, prompts, params))
        print(json.dumps({"warmup_seconds": warmup, "seconds": [s for s, _ in runs],
                          "tokens": [t for _, t in runs]}), flush=True)


if __name__ == "__main__":
    main()
