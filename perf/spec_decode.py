"""Speculative decoding at batch 1: tokens/s without it, with n-gram prompt lookup and with a draft model made
of the target's first layers, in one run, on a repetitive workload (continuing a text that repeats itself),
with acceptance rates.

    .venv/bin/python perf/spec_decode.py [--quick]
"""

from __future__ import annotations

import argparse
import time

from common import emit, model_dir, random_workload
from pagedllm import LLM, SamplingParams
from pagedllm.tiny_model import first_layers_model


def run(path, prompt, max_tokens, spec):
    llm = LLM(path, dtype="bfloat16", max_model_len=2048, kv_cache_memory_bytes=256 << 20,
              speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    elapsed = time.perf_counter() - t0
    s = llm.get_stats()
    return out.outputs[0].token_ids, len(out.outputs[0].token_ids) / elapsed, s


def damp_later_layers(src: str, dst: str, keep: int, scale: float) -> str:
    """A target whose layers after the first `keep` only nudge the residual stream (their output projections
    scaled by `scale`), as a trained model's refinement layers roughly do: its first layers then make a
    draft with high acceptance, which random weights alone never give."""
    import os
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    w = load_file(os.path.join(dst, "model.safetensors"))
    for name in list(w):
        parts = name.split(".")
        if name.startswith("model.layers.") and int(parts[2]) >= keep and parts[-2] in ("o_proj", "down_proj"):
            w[name] = w[name] * scale
    save_file(w, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return dst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--damp-scale", type=float, default=0.02)
    ap.add_argument("--damped", action="store_true",
                    help="target with layers after the 2nd damped, so its first 2 layers draft well")
    args = ap.parse_args()
    size = "tiny" if args.quick else "125m"
    path = model_dir("llama", size, "bfloat16")
    unit = random_workload(1, 48, 48, 2000, seed=7)[0]
    prompt = unit * 4  # a text that repeats: what prompt lookup is for
    max_tokens = args.max_tokens or (64 if args.quick else 256)
    if args.damped:
        path = damp_later_layers(path, path + f"-damped{args.damp_scale}", 2, args.damp_scale)
    base_tokens, base_tps, _ = run(path, prompt, max_tokens, None)
    draft = first_layers_model(path, path + "-first2", 2)
    configs = {"ngram": {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1,
                         "prompt_lookup_max": 3},
               "draft_first_2_layers": {"method": "draft_model", "model": draft, "num_speculative_tokens": args.k}}
    for name, spec in configs.items():
        spec_tokens, spec_tps, s = run(path, prompt, max_tokens, spec)
        emit({"model": f"llama-{size}" + ("-damped" if args.damped else ""), "method": name, "batch": 1, "max_tokens": max_tokens, "k": args.k,
              "tokens_per_s_plain": round(base_tps, 1), "tokens_per_s_spec": round(spec_tps, 1),
              "speedup": round(spec_tps / base_tps, 2), "identical_greedy_output": base_tokens == spec_tokens,
              "acceptance_rate": round(s.spec_decode_num_accepted_tokens / max(1, s.spec_decode_num_draft_tokens), 3),
              "accepted_per_position": s.spec_decode_accepted_per_position,
              "verification_steps": s.spec_decode_num_drafts})


if __name__ == "__main__":
    main()
