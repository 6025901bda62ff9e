"""AWQ's and GPTQ's packings, written from the formats' descriptions: words checked against hand-packed
values, pack / unpack round trips (desc_act's g_idx included), and round-to-nearest codes within half a step."""

import pytest
import torch

from pagedllm.models.quantization import int4_formats as f
from pagedllm.models.quantization.config import read_quantization_config


def test_gptq_words_by_hand():
    """qweight packs 8 input rows per word, row 8r + i in nibble i; qzeros stores zero - 1 (v1)."""
    codes = (torch.arange(8)[None, :].repeat(16, 1)).to(torch.uint8)  # q[n, k] = k
    w = f.Int4Weight(codes, torch.full((16, 1), 8, dtype=torch.int16), torch.ones(16, 1), torch.zeros(8).long())
    packed = f.pack_gptq(w)
    assert packed["qweight"].shape == (1, 16) and int(packed["qweight"][0, 3]) == 0x76543210
    assert packed["qzeros"].shape == (1, 2) and int(packed["qzeros"][0, 0]) == 0x77777777
    assert packed["scales"].dtype == torch.float16 and packed["scales"].shape == (1, 16)


def test_awq_words_by_hand():
    """qweight packs 8 output columns per word in AutoAWQ's order 0 2 4 6 1 3 5 7."""
    codes = torch.arange(8)[:, None].repeat(1, 32).to(torch.uint8)  # q[n, k] = n for 8 columns
    w = f.Int4Weight(codes, torch.zeros(8, 1, dtype=torch.int16), torch.ones(8, 1), torch.zeros(32).long())
    packed = f.pack_awq(w)
    assert packed["qweight"].shape == (32, 1) and int(packed["qweight"][5, 0]) == 0x75316420
    top = f.Int4Weight(torch.full((8, 32), 15, dtype=torch.uint8), w.zeros, w.scales, w.g_idx)
    assert int(f.pack_awq(top)["qweight"][0, 0]) == -1  # all ones: bit 31 set, as int32 holds it


def random_weight(n, k, group, desc_act=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    if desc_act:
        order = torch.randperm(k, generator=g)
        g_idx = torch.empty(k, dtype=torch.long)
        g_idx[order] = torch.arange(k) // group
    else:
        g_idx = f.group_index(k, group)
    groups = int(g_idx.max()) + 1
    return f.Int4Weight(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
                        torch.randint(1, 16, (n, groups), generator=g, dtype=torch.int16),
                        torch.rand(n, groups, generator=g).half().float(), g_idx)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_round_trip(group, desc_act):
    w = random_weight(48, 256, group, desc_act)
    p = f.pack_gptq(w)
    back = f.unpack_gptq(p["qweight"], p["qzeros"], p["scales"], p["g_idx"])
    for a, b in ((w.codes, back.codes), (w.zeros, back.zeros), (w.g_idx, back.g_idx)):
        assert torch.equal(a, b)
    torch.testing.assert_close(back.dequantize(), w.dequantize())


def test_gptq_v1_zero_of_zero_reads_back_as_sixteen():
    """The format's own quirk, kept as AutoGPTQ and vLLM read it (our quantizer never writes a zero of 0)."""
    w = random_weight(16, 64, 32)
    w.zeros[:] = 0
    p = f.pack_gptq(w)
    assert (f.unpack_gptq(p["qweight"], p["qzeros"], p["scales"], p["g_idx"]).zeros == 16).all()


@pytest.mark.parametrize("group", [32, 64, 128, -1])
def test_awq_round_trip(group):
    w = random_weight(48, 256, 256 if group == -1 else group)
    p = f.pack_awq(w)
    back = f.unpack_awq(p["qweight"], p["qzeros"], p["scales"], group)
    assert torch.equal(back.codes, w.codes) and torch.equal(back.zeros, w.zeros)
    torch.testing.assert_close(back.dequantize(), w.dequantize())


@pytest.mark.parametrize("sym", [True, False])
def test_round_to_nearest_is_within_half_a_step(sym):
    weight = torch.randn(32, 128)
    w = f.quantize_rtn(weight, f.group_index(128, 32), sym)
    step, err = w.scales[:, w.g_idx], (w.dequantize() - weight).abs()
    clipped = w.codes == 15  # symmetric: +amax is 7.5 steps up, one past the top code (as GPTQ's quantizer)
    assert (err[~clipped] <= step[~clipped] / 2 + 1e-6).all() and (err <= step + 1e-6).all()


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    ({"quant_method": "compressed-tensors"}, "0 config groups"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int",
                                                                                "strategy": "group"}}}}, "weights"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "8-bit gptq"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "gemv"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "group_size"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 48}, "multiple of 32"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {
        "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
        "input_activations": {"num_bits": 8, "type": "float", "dynamic": True, "symmetric": False}}}},
     "input activations"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "gptq_v2"}, "gptq_v2"),
])
def test_unsupported_configs_are_refused_by_name(qc, message):
    class Config:
        quantization_config = qc

    with pytest.raises(ValueError, match=message):
        read_quantization_config(Config())


def test_compressed_tensors_ignore_takes_names_and_patterns():
    class Config:
        quantization_config = {"quant_method": "compressed-tensors", "ignore": ["lm_head", "re:.*layers\\.1\\..*"],
                               "config_groups": {"g": {"weights": {"num_bits": 8, "type": "float",
                                                                   "strategy": "channel"}}}}

    c = read_quantization_config(Config())
    assert not c.quantizes("lm_head") and not c.quantizes("model.layers.1.mlp.down_proj")
    assert c.quantizes("model.layers.0.mlp.down_proj") and c.quantizes("model.layers.10.mlp.down_proj")
