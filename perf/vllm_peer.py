"""Runs inside vLLM's own venv (perf/throughput.py --with-vllm starts it): the same workload through
vllm.LLM.generate, printing one JSON line. Reads the workload from the JSON file given as argv[1]."""

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
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(json.dumps({"peer_tokens": tokens, "peer_seconds": elapsed}), flush=True)


if __name__ == "__main__":
    main()
