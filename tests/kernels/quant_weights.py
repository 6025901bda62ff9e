"""Random quantized weights the int4 and fp8-weight kernel tests share (every CPU kernel and the Triton ones)."""

import torch

FP8 = torch.float8_e4m3fn


def int4_weight(n, k, group, seed=0):
    """(codes [n, k] 0..15, scales [n, groups], zeros [n, groups])."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 16, (n, k // group), generator=g)
    return codes, scales, zeros


def fp8_weight(n, k, seed=0):
    """(e4m3 [n, k] of every finite kind: subnormals, ±448, both zeros; per-column scales [n])."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaNs: checkpoints hold finite values
    codes[0, :8] = torch.tensor([0x01, 0x07, 0x08, 0x7E, 0x81, 0xFE, 0x00, 0x80], dtype=torch.uint8)
    return codes.view(FP8), torch.rand(n, generator=g) * 0.1 + 0.01
