"""`pagedllm` command line: make-tiny-model, generate, batch, serve, openai (generate and batch also under
torchrun)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from pagedllm.config import KV_CACHE_DTYPES


def _make_tiny_model(args) -> None:
    from pagedllm.tiny_model import make_tiny_model

    make_tiny_model(args.dir, arch=args.arch, size=args.size, seed=args.seed, dtype=args.dtype,
                    max_shard_size=args.max_shard_size)
    print(f"wrote {args.arch} ({args.size}) model to {args.dir}")


def _generate(args) -> None:
    from pagedllm import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed,
              tensor_parallel_size=args.tensor_parallel_size, device=args.device, kv_cache_dtype=args.kv_cache_dtype,
              calculate_kv_scales=args.calculate_kv_scales, quantization=args.quantization)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.sample_seed, stop=args.stop or [])
    for out in llm.generate(args.prompts, params, use_tqdm=False):
        c = out.outputs[0]
        print(json.dumps({"prompt": out.prompt, "text": c.text, "num_output_tokens": len(c.token_ids),
                          "finish_reason": c.finish_reason}))


def _batch(args) -> None:
    from pagedllm import LLM, SamplingParams
    from pagedllm.batch.runner import run_batch

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed,
              max_num_seqs=args.max_num_seqs, tensor_parallel_size=args.tensor_parallel_size, device=args.device,
              kv_cache_dtype=args.kv_cache_dtype, calculate_kv_scales=args.calculate_kv_scales,
              quantization=args.quantization)
    defaults = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              max_tokens=args.max_tokens)
    summary = run_batch(llm, args.input, args.output, defaults, prompt_field=args.prompt_field,
                        id_field=args.id_field, resume=args.resume, show_progress=not args.quiet)
    print(summary.line(), flush=True)


def _serve(args) -> None:
    from pagedllm.serving.launcher import serve

    sys.exit(serve(args))


def _openai(args) -> None:
    from pagedllm.openai.server import run  # lazily: the front end only speaks gRPC to Triton

    sys.exit(run(args))


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="ranks to split the model over (worker processes are started, or torchrun's are used)")
    p.add_argument("--device", default="auto", help="auto (CUDA when present), cpu, cuda")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="auto (the model's dtype) or fp8 (e4m3: half of bf16's KV bytes per token)")
    p.add_argument("--calculate-kv-scales", action="store_true",
                   help="with --kv-cache-dtype fp8: each layer's K/V scale computed at load from a calibration text")
    p.add_argument("--quantization", default=None, choices=["int8"],
                   help="int8: W8A8 made at load from a dense checkpoint (CPU with AVX512-VNNI)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny-model", help="write an HF-style model directory with random weights")
    p.add_argument("dir")
    p.add_argument("--arch", default="llama", choices=["llama", "mistral", "qwen2", "qwen3"])
    p.add_argument("--size", default="tiny", choices=["tiny", "small", "125m", "1b"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-shard-size", default=None, help="e.g. 1MB: write a sharded checkpoint")
    p.set_defaults(func=_make_tiny_model)

    p = sub.add_parser("generate", help="generate offline for prompts given on the command line")
    p.add_argument("prompts", nargs="+")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--stop", action="append")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-seed", type=int, default=None)
    _add_engine_arguments(p)
    p.set_defaults(func=_generate)

    p = sub.add_parser("batch", help="run prompts from a JSONL/CSV/Parquet file; results to JSONL/Parquet")
    p.add_argument("input")
    p.add_argument("output")
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-field", default="prompt")
    p.add_argument("--id-field", default="id", help="row ids (default: the row's index)")
    p.add_argument("--resume", action="store_true", help="skip ids already in the output")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=None, help="default for rows without max_tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_engine_arguments(p)
    p.set_defaults(func=_batch)

    from pagedllm.serving.launcher import add_serve_arguments

    p = sub.add_parser("serve", help="serve a model through a real tritonserver")
    add_serve_arguments(p)
    p.set_defaults(func=_serve)

    from pagedllm.openai.server import add_openai_arguments

    p = sub.add_parser("openai", help="an OpenAI-compatible HTTP front end for a running Triton (over gRPC)")
    add_openai_arguments(p)
    p.set_defaults(func=_openai)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    from pagedllm.engine.executor.multiproc import launched_by_torchrun

    if launched_by_torchrun() and int(os.environ["RANK"]) > 0:
        # `torchrun ... -m pagedllm.cli generate|batch ...`: rank 0 runs the engine, the others serve it.
        from pagedllm.engine.executor.worker_main import run_torchrun_worker

        run_torchrun_worker(getattr(args, "device", "auto"))
        return
    args.func(args)


if __name__ == "__main__":
    main()
