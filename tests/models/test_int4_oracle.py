"""AWQ and GPTQ checkpoints through the engine against transformers (fp32) on their dequantized twins
(pagedllm/models/quantization/tiny_checkpoints.py): in fp32 (torch's dequantization) the logits match to
fp32 rounding and the greedy tokens are identical; in bf16 (our C++ kernel, dequantizing inside the matmul)
the tokens agree teacher-forced wherever the twin's top-2 margin allows bf16's rounding."""

import pytest
import torch
from conftest import agreement_with_transformers, assert_all_blocks_free, random_prompts
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.models.layers.int4_linear import Int4Linear
from pagedllm.models.quantization.tiny_checkpoints import make_int4_checkpoint

LENGTHS = [1, 5, 17, 40, 100, 64]
MAX_TOKENS = [12, 5, 16, 8, 8, 10]
FORMATS = [("awq", 128, False, False), ("awq", 32, False, False), ("gptq", 128, False, True),
           ("gptq", 64, True, True), ("gptq", 32, True, False)]  # method, group, desc_act, sym
BF16_FLIP_MARGIN = 0.3  # logprob units: bf16 activations round at ~0.4% per op, over 2 layers


@pytest.fixture(scope="module")
def checkpoints(model_dir, tmp_path_factory):
    made = {}

    def get(arch, method, group, desc_act, sym):
        key = (arch, method, group, desc_act, sym)
        if key not in made:
            out = tmp_path_factory.mktemp("int4") / f"{arch}-{method}-{group}-{desc_act}-{sym}"
            made[key] = make_int4_checkpoint(model_dir(arch), str(out), method, group, desc_act, sym)
        return made[key]

    return get


def hf_logits_and_greedy(model_dir, prompts, max_tokens):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = []
    with torch.no_grad():
        for p, m in zip(prompts, max_tokens):
            out = hf.generate(torch.tensor([p]), max_new_tokens=m, min_new_tokens=m, do_sample=False)
            tokens.append(out[0, len(p):].tolist())
        first = hf(torch.tensor([prompts[2]])).logits[0].log_softmax(-1)
    return tokens, first


@pytest.mark.parametrize("method,group,desc_act,sym", FORMATS)
def test_fp32_matches_transformers_on_the_dequantized_twin(checkpoints, method, group, desc_act, sym):
    quantized, twin = checkpoints("llama", method, group, desc_act, sym)
    prompts = random_prompts(LENGTHS)
    want_tokens, want_logprobs = hf_logits_and_greedy(twin, prompts, MAX_TOKENS)
    llm = LLM(quantized, dtype="float32", max_model_len=512, kv_cache_memory_bytes=16 << 20)
    layers = [m for m in llm.engine.executor.model.modules() if isinstance(m, Int4Linear)]
    assert len(layers) == 4 * 2  # qkv, o, gate_up, down per layer: every projection stays int4
    assert all((m.perm is not None) == desc_act for m in layers)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want_tokens
    scored = llm.generate([{"prompt_token_ids": prompts[2]}],
                          SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    ours = [next(iter(lp.values())).logprob for lp in scored.prompt_logprobs[1:]]
    theirs = want_logprobs[:-1].gather(1, torch.tensor(prompts[2][1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(ours), theirs, atol=1e-4, rtol=1e-4)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("method,group,desc_act,sym", [FORMATS[0], FORMATS[3]])
def test_bf16_kernel_agrees_with_transformers(checkpoints, arch, method, group, desc_act, sym):
    quantized, twin = checkpoints(arch, method, group, desc_act, sym)
    prompts = random_prompts(LENGTHS)
    want_tokens, _ = hf_logits_and_greedy(twin, prompts, MAX_TOKENS)
    seqs = [p + t for p, t in zip(prompts, want_tokens)]
    hf = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    llm = LLM(quantized, dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=16 << 20, device="cpu")
    scored = llm.generate([{"prompt_token_ids": s} for s in seqs],
                          SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    same, total = agreement_with_transformers(hf, prompts, seqs, scored, BF16_FLIP_MARGIN)
    assert same >= 0.95 * total
    assert_all_blocks_free(llm)


def test_refusals_name_the_problem(checkpoints, model_dir, tmp_path):
    quantized, _ = checkpoints("llama", "awq", 128, False, False)
    with pytest.raises(ValueError, match="awq checkpoints run on one rank"):
        LLM(quantized, max_model_len=128, enable_lora=True)
    with pytest.raises(ValueError, match="already quantized"):
        LLM(quantized, max_model_len=128, quantization="int8", device="cpu")
    phi3, _ = make_int4_checkpoint(model_dir("phi3"), str(tmp_path / "phi3"), "gptq", 32, False, True)
    with pytest.raises(ValueError, match="Phi-3"):
        LLM(phi3, max_model_len=128)
