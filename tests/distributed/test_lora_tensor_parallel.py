"""Multi-LoRA under tensor parallelism (TP=2 over gloo): each rank holds A split like its layer's input and B
like its output (row-parallel deltas join the partial product before the all-reduce), and a batch mixing
adapters and the base model gives the tokens of transformers on each merged model, fp32."""

import sys
from pathlib import Path

import pytest

from conftest import assert_all_blocks_free, random_prompts
from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.tiny_model import LORA_TARGETS, make_lora_adapter

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from test_lora_oracle import merged_greedy  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_lora_under_tensor_parallelism_matches_merged_transformers(model_dir, tmp_path, arch):
    d = model_dir(arch)
    extra = ("embed_tokens", "lm_head") if arch == "llama" else ()
    models = [LoRARequest("a", 1, make_lora_adapter(d, str(tmp_path / "a"), rank=8, seed=1, targets=LORA_TARGETS + extra)),
              LoRARequest("b", 2, make_lora_adapter(d, str(tmp_path / "b"), rank=16, seed=2)), None]
    prompts = random_prompts([4, 30, 64, 17, 90, 9], seed=21)
    max_tokens = [9, 12, 6, 10, 8, 11]
    loras = [models[i % 3] for i in range(len(prompts))]
    expected = [merged_greedy(d, lo, [p], [m])[0] for p, m, lo in zip(prompts, max_tokens, loras)]
    llm = LLM(d, dtype="float32", tensor_parallel_size=2, kv_cache_memory_bytes=8 << 20, max_model_len=256,
              enable_lora=True, max_loras=2, max_lora_rank=16)
    try:
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()
