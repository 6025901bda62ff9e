"""Runs inside vLLM's own venv (perf/moe.py --with-vllm starts it, with vLLM's documented CPU setup): the same
workload through vllm.LLM.generate as the caller's, at steady state: one full untimed pass, then `rounds`
timed passes, each after resetting the prefix cache. Prints one JSON line. Reads the workload from the JSON
file given as argv[1]."""

import json
import sys
import time

from vllm import LLM, SamplingParams


def main() -> None:
    work = json.load(open(sys.argv[1]))
    llm = LLM(model=work["model"], dtype=work["dtype"], max_model_len=work["max_model_len"], seed=0,
              max_num_seqs=work["max_num_seqs"], enforce_eager=False)
    params = SamplingParams(temperature=0, max_tokens=work["max_tokens"], ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in work["prompts"]]
    llm.generate(prompts, params, use_tqdm=False)  # a full warm-up pass, as the caller's engine gets
    runs = []
    for _ in range(work["rounds"]):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append((sum(len(o.outputs[0].token_ids) for o in outs), time.perf_counter() - t0))
    print(json.dumps({"peer_runs": runs}), flush=True)


if __name__ == "__main__":
    main()
