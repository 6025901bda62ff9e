"""The batched LoRA delta kernels against their torch references: the C++ bf16 kernel (groups of tokens per
slot), the Triton SGMV kernel under the interpreter (segments of consecutive rows), and the model layer's
grouped torch path, at shapes on and around the kernels' block edges (4 tokens, 4 ranks, 32 input and 64 output
columns), with ranks below the maximum, empty groups and rows that use no adapter; and the mixture-of-experts
layer's GPU path, which runs its grouped matmuls through the same Triton kernel."""

import numpy as np
import pytest
import torch
from pagedllm_kernels.cpu import build
from pagedllm_kernels.cpu import lora as cpu_lora
from pagedllm_kernels.lora_sgmv import reference_sgmv, sgmv

from pagedllm.models.lora.layers import LoRABatch, LoRALinear, LoRAState

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernel: under the interpreter on CPU
SHAPES = [  # tokens, in, slice outputs, max rank, ranks of the slots
    (1, 32, [16], 4, [4]),
    (5, 33, [17, 3], 4, [3, 4]),
    (37, 100, [50, 30, 30], 8, [8, 3, 5]),
    (64, 128, [128, 64, 64], 16, [16, 8, 16, 4]),
    (130, 64, [65, 129], 16, [1, 16, 0]),
]


def groups_for(slots: np.ndarray, num_slots: int):
    groups = [np.flatnonzero(slots == s) for s in range(num_slots)]
    tokens = torch.from_numpy(np.concatenate(groups)).long()
    start = torch.tensor([0] + np.cumsum([len(g) for g in groups]).tolist())
    return tokens, start, torch.arange(num_slots)


def operands(tokens, k, outs, max_rank, num_slots, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    ranks = len(outs) * max_rank
    x = torch.randn(tokens + 2, k, generator=g).to(dtype)[1:-1]  # a view: rows not at offset 0
    y = torch.randn(tokens, sum(outs), generator=g).to(dtype)
    a = (torch.randn(num_slots, ranks, k, generator=g) * 0.3).to(dtype)
    b = (torch.randn(num_slots, ranks, sum(outs), generator=g) * 0.3).to(dtype)
    return x, y, a, b


@pytest.mark.skipif(not build.cpu_supported()[0], reason=build.cpu_supported()[1])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"T{s[0]}-in{s[1]}-r{s[3]}")
def test_cpu_lora_kernel_matches_reference(shape):
    tokens, k, outs, max_rank, ranks = shape
    num_slots = len(ranks)
    x, y, a, b = operands(tokens, k, outs, max_rank, num_slots, torch.bfloat16, seed=tokens)
    rng = np.random.default_rng(tokens)
    slots = rng.integers(-1, num_slots, tokens)  # -1: the base model
    tok, start, slot_ids = groups_for(slots, num_slots)
    offsets = torch.tensor([0] + np.cumsum(outs).tolist())
    rank = torch.tensor(ranks)
    got = cpu_lora.lora_delta_(y.clone(), x, a, b, tok, start, slot_ids, rank, offsets, max_rank)
    want = cpu_lora.reference_lora_delta_(y.clone(), x, a, b, tok, start, slot_ids, rank, offsets, max_rank)
    # bf16 output: one rounding of (y + delta) either way; the sums run in fp32 in a different order.
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=1e-2)
    untouched = torch.from_numpy(slots < 0)
    assert torch.equal(got[untouched], y[untouched])  # base rows are not written
    live = torch.from_numpy(np.isin(slots, [s for s, r in enumerate(ranks) if r > 0]))
    if live.any():
        assert not torch.equal(got[live], y[live])  # the delta arrived


@pytest.mark.skipif(not build.cpu_supported()[0], reason=build.cpu_supported()[1])
def test_cpu_lora_kernel_rejects_inconsistent_inputs():
    x, y, a, b = operands(8, 32, [16], 4, 2, torch.bfloat16, seed=0)
    tok, start, slot_ids = groups_for(np.zeros(8, dtype=np.int64), 2)
    offsets, rank = torch.tensor([0, 16]), torch.tensor([4, 4])
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_lora.lora_delta_(y.float(), x, a, b, tok, start, slot_ids, rank, offsets, 4)
    with pytest.raises(RuntimeError, match="outside x"):
        cpu_lora.lora_delta_(y, x, a, b, tok + 100, start, slot_ids, rank, offsets, 4)
    with pytest.raises(RuntimeError, match="slot or rank"):
        cpu_lora.lora_delta_(y, x, a, b, tok, start, slot_ids, torch.tensor([9, 4]), offsets, 4)


def segments(slots: np.ndarray):
    edges = np.flatnonzero(np.diff(slots)) + 1
    starts = np.concatenate([[0], edges])
    lens = np.diff(np.concatenate([starts, [len(slots)]]))
    keep = slots[starts] >= 0
    return (torch.from_numpy(starts[keep]), torch.from_numpy(lens[keep]), torch.from_numpy(slots[starts][keep]),
            int(lens[keep].max()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["shrink", "expand"])
def test_triton_sgmv_matches_reference(dtype, accumulate):
    rows = [3, 16, 17, 1, 40]  # segment lengths around the 16-row block
    seg_slots = [0, 2, -1, 1, 2]
    slots = np.concatenate([[s] * n for s, n in zip(seg_slots, rows)])
    seg_start, seg_len, seg_slot, longest = (t.to(DEVICE) if torch.is_tensor(t) else t for t in segments(slots))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(len(slots), 48, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(3, 48, 70, generator=g).to(dtype).to(DEVICE)
    y = torch.randn(len(slots), 70, generator=g).to(dtype).to(DEVICE)
    got = sgmv(x, w, y.clone(), seg_start, seg_len, seg_slot, longest, accumulate).cpu()
    want = reference_sgmv(x, w, y.clone(), seg_start, seg_len, seg_slot, accumulate).cpu()
    y = y.cpu()
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    base = torch.from_numpy(slots < 0)
    assert torch.equal(got[base], y[base])


def test_triton_sgmv_rejects_bad_shapes():
    x, w, y = torch.zeros(4, 8), torch.zeros(2, 9, 5), torch.zeros(4, 5)
    seg = torch.tensor([0])
    with pytest.raises(ValueError, match="do not chain"):
        sgmv(x, w, y, seg, seg + 4, seg, 4, False)


@pytest.mark.parametrize("path", ["grouped", "kernel", "sgmv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lora_linear_paths_match_per_token_reference(dtype, path):
    """LoRALinear's three ways to the delta, each row getting its own slot's: grouped bmm (fp32 on CPU), the C++
    kernel (bf16 on CPU), Triton SGMV (GPU; here under the interpreter)."""
    if path == "kernel" and (dtype != torch.bfloat16 or not build.cpu_supported()[0]):
        pytest.skip("the C++ kernel takes bf16 on AVX512-BF16 CPUs")
    g = torch.Generator().manual_seed(2)
    base = torch.nn.Linear(24, 20, bias=False).to(dtype)
    state = LoRAState()
    layer = LoRALinear(base, [("q_proj", 0, 12), ("k_proj", 0, 8)], (0, 24), state, max_loras=3, max_rank=4,
                       kernel=cpu_lora if path == "kernel" else None)
    pairs = {}
    for slot, r in enumerate([4, 2, 3]):
        pairs[slot] = [(torch.randn(r, 24, generator=g), torch.randn(12, r, generator=g)),
                       None if slot == 1 else (torch.randn(r, 24, generator=g), torch.randn(8, r, generator=g))]
        layer.set_slot(slot, pairs[slot])
    slots = np.array([2, -1, 0, 0, 1, 2, 2, -1, 0])
    state.tokens = LoRABatch(slots, "cpu", dtype, sgmv=path == "sgmv")
    x = torch.randn(len(slots), 24, generator=g).to(dtype)
    got = layer(x)
    want = base(x).float()
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        at = 0
        for size, pair in zip([12, 8], pairs[slot]):
            if pair is not None:
                a, b = pair
                want[t, at:at + size] += (x[t].float() @ a.t()) @ b.t()
            at += size
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=6e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), want, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_moe_triton_path_matches_grouped_mm(dtype):
    """The mixture-of-experts layer's GPU path (each expert's sorted rows one SGMV segment; here under the
    interpreter) against its CPU path (torch._grouped_mm), experts with no token included."""
    import torch.nn.functional as F

    from pagedllm.models.layers.moe import FusedMoE

    g = torch.Generator().manual_seed(3)
    moe = FusedMoE(32, 48, 6, 2, True, False, F.silu)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    moe = moe.to(dtype)
    x = torch.randn(13, 32, generator=g).to(dtype)
    with torch.no_grad():
        want = moe(x)
        moe.triton = True
        got = moe(x)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    assert int(moe.expert_tokens.sum()) == 2 * 2 * 13  # two forwards, top-2


@pytest.mark.parametrize("tokens", [1, 5, 13, 70, 300])
def test_fused_moe_packed_cpu_path_matches_grouped_mm(tokens):
    """bf16 on the CPU: the experts packed for oneDNN and run one after another on their rows (pack_experts)
    against torch._grouped_mm on the same weights, from a lone decode row to a prefill (experts with no
    token included at the small sizes)."""
    import torch.nn.functional as F

    from pagedllm.models.layers.moe import FusedMoE, pack_experts
    from pagedllm.models.layers.packed_linear import packing_available

    if not packing_available():
        pytest.skip("no oneDNN weight packing in this torch build")
    g = torch.Generator().manual_seed(tokens)
    moe = FusedMoE(64, 96, 6, 2, True, False, F.silu)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    moe = moe.to(torch.bfloat16)
    x = torch.randn(tokens, 64, generator=g).to(torch.bfloat16)
    holder = torch.nn.Sequential(moe)
    with torch.no_grad():
        want = moe(x)
        assert pack_experts(holder) == 1 and moe.packed is not None and moe.w_gate_up.numel() == 0
        got = moe(x)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
