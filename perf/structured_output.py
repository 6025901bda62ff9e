"""Structured output's cost: output tokens/s of a batch where half the requests follow a JSON schema, against
the same batch with no constraint, in one engine, interleaved over several rounds after a warm-up (steady
state), for several schemas and both grammar engines (llguidance, xgrammar); grammar compile time and the
engines' mask fill time reported separately.

The free twin makes exactly the tokens the constrained batch made: each constrained request's output length is
recorded in the warm-up, and its free counterpart gets that many tokens (`max_tokens`, `ignore_eos`), so the
two batches shrink alike as requests finish and the ratio is the grammar's cost alone. Greedy decoding makes
the lengths the same every round (asserted).

Schemas (xgrammar's fill cost depends on them far more than on the model; llguidance's hardly):
- `int_range`: an array of at least 500 integers in 0..9999 (runs every request to max_tokens). A numeric
  range is the costliest JSON construct we found for xgrammar: ~70-140 µs per row of context-dependent digit
  tokens (llguidance: ~5 µs);
- `record`: an extraction object (name, age in 0..150, an enum, a list of tags), the shape of a typical API;
- `json_object`: OpenAI's `response_format: json_object` (any JSON object).

    .venv/bin/python perf/structured_output.py [--quick] [--size small|125m] [--rounds 5] [--schemas a,b]
        [--backends guidance,xgrammar]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from common import emit, model_dir, random_workload
from pagedllm import LLM, SamplingParams

SCHEMAS = {
    "int_range": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9999}, "minItems": 500},
    "record": {"type": "object", "required": ["name", "age", "status", "tags"], "properties": {
        "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "status": {"enum": ["active", "inactive", "pending"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 8}}},
    "json_object": {"type": "object"},
}


def generate(llm, prompts, params) -> tuple[float, list[int]]:
    """Seconds and each request's output length (every pass prefills its prompts: no reuse of the last one's)."""
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t0, [len(o.outputs[0].token_ids) for o in outs]


class FillTimer:
    """Wall time spent in the grammar engine's mask fills (its per-step cost) and how many rows it filled."""

    def __init__(self) -> None:
        import pagedllm.engine.structured_output.request_grammar as module

        self.seconds, self.rows, inner = 0.0, 0, module._fill

        def timed_fill(grammars):
            t0 = time.perf_counter()
            try:
                return inner(grammars)
            finally:
                self.seconds += time.perf_counter() - t0
                self.rows += len(grammars)
        module._fill = timed_fill


def compile_times(llm, schema, backend: str) -> dict:
    compiler = llm.engine.input_processor
    miss = []
    for i in range(5):  # fresh schemas: cache misses (the first of a backend also reads the vocabulary)
        t0 = time.perf_counter()
        spec = {"json": dict(schema, description=f"{i}"), "backend": backend}
        compiler.compile_grammar(SamplingParams(structured_outputs=spec))
        miss.append((time.perf_counter() - t0) * 1e3)
    compiler.compile_grammar(SamplingParams(structured_outputs={"json": schema, "backend": backend}))
    t0 = time.perf_counter()
    compiler.compile_grammar(SamplingParams(structured_outputs={"json": json.dumps(schema), "backend": backend}))
    return {"compile_ms_cache_miss": [round(x, 2) for x in miss],
            "compile_ms_cache_hit": round((time.perf_counter() - t0) * 1e3, 3)}


def measure(llm, fills: FillTimer, name: str, backend: str, prompts, rounds: int, max_tokens: int) -> dict:
    n = len(prompts)
    constrained = SamplingParams(temperature=0, max_tokens=max_tokens,
                                 structured_outputs={"json": SCHEMAS[name], "backend": backend})
    free = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    mixed = [constrained if i % 2 else free for i in range(n)]
    compile_ms = compile_times(llm, SCHEMAS[name], backend)
    _, lengths = generate(llm, prompts, mixed)  # warm-up, and the lengths the free twin copies
    twin = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in lengths]
    generate(llm, prompts, twin)
    ratios, free_tps, mixed_tps = [], [], []
    fills.seconds = fills.rows = 0
    for _ in range(rounds):
        tf, nf = generate(llm, prompts, twin)
        tm, nm = generate(llm, prompts, mixed)
        assert nf == nm == lengths, "greedy outputs changed length between rounds"
        free_tps.append(sum(nf) / tf)
        mixed_tps.append(sum(nm) / tm)
        ratios.append(mixed_tps[-1] / free_tps[-1])
    return {"schema": name, "backend": backend, "constrained_tokens_mean": round(statistics.mean(lengths[1::2]), 1),
            "free_tokens_per_s": [round(x, 1) for x in free_tps],
            "half_constrained_tokens_per_s": [round(x, 1) for x in mixed_tps],
            "ratio_per_round": [round(r, 3) for r in ratios], "ratio_median": round(statistics.median(ratios), 3),
            "fill_us_per_row": round(fills.seconds / max(fills.rows, 1) * 1e6, 1), **compile_ms}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--size", default="small")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--schemas", default=",".join(SCHEMAS))
    ap.add_argument("--backends", default="guidance,xgrammar", help="grammar engines, each over every schema")
    args = ap.parse_args()
    size, rounds, n = ("tiny", 2, 16) if args.quick else (args.size, args.rounds, args.num_seqs)
    llm = LLM(model_dir("llama", size, "bfloat16"), dtype="bfloat16", max_model_len=1024,
              kv_cache_memory_bytes=1 << 30, max_num_seqs=n)
    prompts = random_workload(n, 32, 256, 2000, seed=1)
    fills = FillTimer()
    generate(llm, prompts[:4], SamplingParams(temperature=0, max_tokens=8))  # kernels, attention race, allocator
    for backend in args.backends.split(","):
        ratios = []
        for name in args.schemas.split(","):
            record = measure(llm, fills, name, backend, prompts, rounds, args.max_tokens)
            ratios.append(record["ratio_median"])
            emit({"model": f"llama-{size}", "num_seqs": n, "constrained": n // 2, "max_tokens": args.max_tokens,
                  **record, "target": 0.85})
        emit({"model": f"llama-{size}", "backend": backend, "ratio_median_min": min(ratios),
              "ratio_median_geomean": round(statistics.geometric_mean(ratios), 3)})


if __name__ == "__main__":
    main()
