"""quantization="int8" (W8A8 at load, CPU): the projections become int8, the greedy tokens agree with the
bf16 model teacher-forced wherever its margin allows, blocks all return; and the refusals."""

import pytest
import torch
from conftest import assert_all_blocks_free, random_prompts

from pagedllm import LLM, SamplingParams
from pagedllm.models.layers.int8_linear import Int8Linear
from pagedllm_kernels.cpu import int8_linear

ok, why = int8_linear.vnni_supported()
FLIP_MARGIN = 0.5  # logprob units: per-token int8 activations are off by up to 1/254 of their row's max
LENGTHS = [1, 5, 17, 40, 100, 64]
MAX_TOKENS = [12, 5, 16, 8, 8, 10]


@pytest.mark.skipif(not ok, reason=why)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int8_agrees_with_bf16(model_dir, arch):
    kw = dict(dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=16 << 20, device="cpu")
    base = LLM(model_dir(arch), **kw)
    prompts = random_prompts(LENGTHS)
    outs = base.generate([{"prompt_token_ids": p} for p in prompts],
                         [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS],
                         use_tqdm=False)
    seqs = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    params = SamplingParams(max_tokens=1, prompt_logprobs=5)
    want = base.generate([{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
    int8 = LLM(model_dir(arch), quantization="int8", **kw)
    assert sum(isinstance(m, Int8Linear) for m in int8.engine.executor.model.modules()) == 8
    got = int8.generate([{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
    same = total = 0
    for w, g, p in zip(want, got, prompts):
        for pos in range(len(p), len(w.prompt_token_ids)):
            ws = {t: lp.logprob for t, lp in w.prompt_logprobs[pos].items()}
            gs = {t: lp.logprob for t, lp in g.prompt_logprobs[pos].items()}
            top_w, top_g = max(ws, key=ws.get), max(gs, key=gs.get)
            total += 1
            if top_w == top_g:
                same += 1
            else:
                assert ws[top_w] - ws.get(top_g, float("-inf")) < FLIP_MARGIN, (pos, ws, gs)
    assert same >= 0.95 * total
    assert_all_blocks_free(int8)


def test_int8_refusals(model_dir, tmp_path):
    with pytest.raises(ValueError, match="quantization"):
        LLM(model_dir("llama"), quantization="int4")
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="runs on CPU"):
            LLM(model_dir("llama"), quantization="int8", device="cuda")
    with pytest.raises(ValueError, match="runs on CPU, on one rank, without LoRA"):
        LLM(model_dir("llama"), quantization="int8", enable_lora=True, device="cpu")
    with pytest.raises(ValueError, match="not experts"):  # routers are Linear layers too: not quantized apart
        LLM(model_dir("mixtral"), quantization="int8", device="cpu")
