"""What the C++ loop over the decoder's layers buys (backend/pagedllm/models/decoder_loop.py): output tokens/s of
one engine with the loop and without it (its modules, one Python call per kernel), alternated run by run in one
process (ABBA, after a warm-up of each), so the host's drift falls on both alike. Each run prefills its prompts
(the prefix cache is reset) and decodes greedily; the tokens of the two must be equal, and are reported.

    .venv/bin/python perf/decoder_loop.py [--quick] [--sizes small,125m,0.5b] [--seqs 1,8,64] [--prompt-len 1800]
        [--outputs 128] [--pairs 4] [--formats bf16,awq,gptq,fp8,int8]

With --seqs N > 1 the prompts' lengths are drawn from [prompt-len / 2, prompt-len]. --formats: the bf16 model,
its int4 (AWQ, GPTQ) and fp8-weight checkpoints (common.quantized_model_dir) and `quantization="int8"` on it.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import emit, model_dir, quantized_model_dir, random_workload
from pagedllm import LLM, SamplingParams

ARCH = {"tiny": "llama", "small": "llama", "125m": "llama", "0.5b": "qwen2"}


def timed(llm, decoder, loop, on: bool, prompts, params) -> tuple[float, list]:
    decoder.decoder_loop = loop if on else None
    llm.reset_prefix_cache()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / seconds, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default="small,125m,0.5b")
    ap.add_argument("--seqs", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=1800)
    ap.add_argument("--outputs", type=int, default=128)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--formats", default="bf16")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.seqs, args.prompt_len, args.outputs, args.pairs = "tiny", "1,4", 64, 16, 1
    for size, fmt in ((s, f) for s in args.sizes.split(",") for f in args.formats.split(",")):
        path = model_dir(ARCH[size], size) if fmt in ("bf16", "int8") else quantized_model_dir(ARCH[size], size, fmt)
        llm = LLM(path, dtype="bfloat16", max_model_len=2560, max_num_seqs=256, kv_cache_memory_bytes=4 << 30,
                  quantization="int8" if fmt == "int8" else None)
        decoder = llm.engine.executor.model.model
        loop = decoder.decoder_loop
        if loop is None:
            emit({"size": size, "format": fmt, "skipped": "the loop does not run here (see the engine's log for why)"})
            continue
        vocab = min(llm.engine.model_info.vocab_size, 30000)
        for seqs in map(int, args.seqs.split(",")):
            low = args.prompt_len if seqs == 1 else args.prompt_len // 2
            prompts = random_workload(seqs, low, args.prompt_len, vocab, seed=seqs)
            params = SamplingParams(temperature=0, max_tokens=args.outputs, ignore_eos=True)
            for on in (True, False):  # warm-up
                timed(llm, decoder, loop, on, prompts, params)
            runs, tokens = {True: [], False: []}, {}
            for i in range(args.pairs):
                for on in ((True, False) if i % 2 == 0 else (False, True)):
                    tps, tokens[on] = timed(llm, decoder, loop, on, prompts, params)
                    runs[on].append(tps)
            ratios = [a / b for a, b in zip(runs[True], runs[False])]
            emit({"size": size, "format": fmt, "seqs": seqs, "prompt_len": args.prompt_len, "outputs": args.outputs,
                  "loop_tokens_per_s": [round(x, 1) for x in runs[True]],
                  "modules_tokens_per_s": [round(x, 1) for x in runs[False]],
                  "ratios": [round(r, 3) for r in ratios], "ratio_median": round(statistics.median(ratios), 3),
                  "same_tokens": tokens[True] == tokens[False]})
        decoder.decoder_loop = loop
        llm.shutdown()


if __name__ == "__main__":
    main()
