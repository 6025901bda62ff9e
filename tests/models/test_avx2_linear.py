"""bf16 linears on the AVX2 kernel (models/layers/avx2_linear.py): what pack_linears does where oneDNN has no
bf16 matmul. Forced here on any AVX2 host by making oneDNN's packing look unavailable."""

import pytest
import torch
from test_oracle import ours

from pagedllm import LLM
from pagedllm.models.layers.avx2_linear import Avx2Linear
from pagedllm.models.layers.packed_linear import pack_linears
from pagedllm_kernels.cpu.build import avx2_module

pytestmark = pytest.mark.skipif(avx2_module("avx2_linear") is None, reason="the AVX2 kernels cannot run or build here")


def test_the_layer_matches_f_linear_with_and_without_bias():
    torch.manual_seed(0)
    for bias in (False, True):
        linear = torch.nn.Linear(96, 40, bias=bias).to(torch.bfloat16)
        layer = Avx2Linear(linear, avx2_module("avx2_linear"))
        x = torch.randn(3, 5, 96).to(torch.bfloat16)  # leading dims kept
        y = layer(x)
        assert y.shape == (3, 5, 40) and y.dtype == torch.bfloat16
        exact = x.double() @ linear.weight.double().t() + (linear.bias.double() if bias else 0)
        torch.testing.assert_close(y.double(), exact, rtol=2 ** -8, atol=1e-3)


def test_pack_linears_uses_it_without_onednn_bf16(monkeypatch):
    monkeypatch.setattr("pagedllm.models.layers.packed_linear.packing_available", lambda: False)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Linear(24, 20), torch.nn.Linear(20, 8).float())
    model[0].to(torch.bfloat16)
    model[1].to(torch.bfloat16)  # 20 outputs: not whole tiles of 8, stays as it is
    assert pack_linears(model) == 1
    assert [type(m).__name__ for m in model] == ["Avx2Linear", "Linear", "Linear"]


@pytest.fixture
def prompts():
    from conftest import random_prompts

    return random_prompts([5, 17, 33, 9, 60, 24, 3, 41], seed=5)


def test_a_bf16_engine_on_it_agrees_with_torch_bf16(model_dir, prompts, monkeypatch):
    """bf16 cannot be token-identical across summation orders; the greedy tokens must agree almost everywhere,
    and every linear of the model (4 per layer, 2 layers, and the LM head) must be on the kernel."""
    d = model_dir("qwen2")
    monkeypatch.setattr("pagedllm.engine.executor.worker.pack_linears", lambda model, use_amx: 0)
    plain = ours(LLM(d, dtype="bfloat16", max_model_len=1024), prompts, [16] * len(prompts))
    monkeypatch.undo()
    monkeypatch.setattr("pagedllm.models.layers.packed_linear.packing_available", lambda: False)
    llm = LLM(d, dtype="bfloat16", max_model_len=1024)
    assert sum(isinstance(m, Avx2Linear) for m in llm.engine.executor.model.modules()) == 4 * 2 + 1
    tokens = ours(llm, prompts, [16] * len(prompts))
    same = sum(a == b for seq_a, seq_b in zip(tokens, plain) for a, b in zip(seq_a, seq_b))
    assert same >= 0.9 * sum(len(s) for s in plain)
