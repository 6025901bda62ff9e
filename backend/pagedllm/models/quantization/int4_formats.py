"""Weight-only int4 checkpoints as published: AutoAWQ's GEMM packing and GPTQ's (v1) packing, both ways.

Both describe a linear layer's weight W [out N, in K] by 4-bit codes q, per-group zero points z and fp16
scales s: W[n, k] = s[g(k), n] * (q[n, k] - z[g(k), n]), where g(k) is input row k's group (k // group_size,
or GPTQ's g_idx with desc_act). Tensors per layer, int32 words of eight 4-bit nibbles, nibble i at bits 4i:

  GPTQ   qweight [K/8, N]   word (r, n) holds q[n, 8r + i] in nibble i (packed along the input)
         qzeros  [G, N/8]   word (g, c) holds z[g, 8c + i] - 1 in nibble i (v1's offset: a zero of 0 reads
                            back as 16, as in AutoGPTQ; symmetric checkpoints store 7 for z = 8)
         scales  [G, N] fp16, g_idx [K] int32
  AWQ    qweight [K, N/8]   word (k, c) holds q[8c + ORDER[i], k] in nibble i (packed along the output, in
                            AutoAWQ's interleaved order ORDER = 0 2 4 6 1 3 5 7)
         qzeros  [G, N/8]   the same packing of z;  scales [G, N] fp16;  no g_idx

`unpack_*` gives the codes as [N, K] uint8 with zeros [N, G], scales [N, G] (float32) and g_idx [K]; `pack_*`
is its inverse (used to make test checkpoints; tests/models/test_int4_formats.py checks both against
hand-packed words). `quantize_rtn` makes codes from a dense weight by round-to-nearest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column ORDER[i] of its 8
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


@dataclass
class Int4Weight:
    """One layer's int4 weight, format-neutral: W[n, k] = scales[n, g] * (codes[n, k] - zeros[n, g]),
    g = g_idx[k]."""

    codes: torch.Tensor  # [N, K] uint8 in 0..15
    zeros: torch.Tensor  # [N, G] int16 (GPTQ v1 may read 16)
    scales: torch.Tensor  # [N, G] float32
    g_idx: torch.Tensor  # [K] int64

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        g = self.g_idx
        return ((self.codes.float() - self.zeros[:, g].float()) * self.scales[:, g]).to(dtype)


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> [..., W, 8] nibble values (nibble i at bits 4i)."""
    return ((words[..., None] >> _SHIFTS) & 0xF).to(torch.uint8)


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., W, 8] values 0..15 -> int32 [..., W] (the inverse of _nibbles, in int64 to hold bit 31)."""
    packed = (nibbles.to(torch.int64) << _SHIFTS.to(torch.int64)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_gptq(qweight, qzeros, scales, g_idx) -> Int4Weight:
    k8, n = qweight.shape
    codes = _nibbles(qweight).permute(1, 0, 2).reshape(n, k8 * 8)  # [K/8, N, 8] -> [N, K]
    zeros = _nibbles(qzeros).reshape(qzeros.shape[0], -1).to(torch.int16) + 1  # [G, N]
    return Int4Weight(codes.contiguous(), zeros.t().contiguous(), scales.float().t().contiguous(),
                      g_idx.long())


def pack_gptq(w: Int4Weight) -> dict[str, torch.Tensor]:
    n, k = w.codes.shape
    qweight = _words(w.codes.reshape(n, k // 8, 8)).t().contiguous()  # [K/8, N]
    stored = (w.zeros.t().to(torch.int64) - 1) & 0xF  # v1 keeps z - 1
    qzeros = _words(stored.reshape(stored.shape[0], n // 8, 8))
    return {"qweight": qweight, "qzeros": qzeros, "scales": w.scales.t().to(torch.float16).contiguous(),
            "g_idx": w.g_idx.to(torch.int32)}


def _awq_columns(words: torch.Tensor) -> torch.Tensor:
    """AWQ words [R, N/8] -> values [R, N] in column order."""
    nib = _nibbles(words)  # [R, N/8, 8]: nibble i is column ORDER[i]
    out = torch.empty_like(nib)
    out[..., list(AWQ_ORDER)] = nib
    return out.reshape(words.shape[0], -1)


def _awq_words(values: torch.Tensor) -> torch.Tensor:
    """values [R, N] -> AWQ words [R, N/8]."""
    r, n = values.shape
    return _words(values.reshape(r, n // 8, 8)[..., list(AWQ_ORDER)])


def unpack_awq(qweight, qzeros, scales, group_size: int) -> Int4Weight:
    k = qweight.shape[0]
    codes = _awq_columns(qweight).t().contiguous()  # [N, K]
    zeros = _awq_columns(qzeros).to(torch.int16).t().contiguous()  # [N, G]
    return Int4Weight(codes, zeros, scales.float().t().contiguous(), group_index(k, group_size))


def pack_awq(w: Int4Weight) -> dict[str, torch.Tensor]:
    return {"qweight": _awq_words(w.codes.t().contiguous()), "qzeros": _awq_words(w.zeros.t().contiguous()),
            "scales": w.scales.t().to(torch.float16).contiguous()}


def group_index(in_features: int, group_size: int) -> torch.Tensor:
    gs = in_features if group_size == -1 else group_size
    return torch.arange(in_features) // gs


def quantize_rtn(weight: torch.Tensor, g_idx: torch.Tensor, sym: bool, zero_range=(0, 15)) -> Int4Weight:
    """Round-to-nearest int4 codes of a dense [N, K] weight over the groups g_idx gives; scales rounded to fp16
    as checkpoints store them. Asymmetric zeros stay within zero_range (GPTQ v1 cannot store a zero of 0)."""
    n, _ = weight.shape
    groups = int(g_idx.max()) + 1
    w = weight.float()
    lo = torch.full((n, groups), float("inf")).scatter_reduce(1, g_idx.expand(n, -1), w, "amin")
    hi = torch.full((n, groups), float("-inf")).scatter_reduce(1, g_idx.expand(n, -1), w, "amax")
    if sym:
        amax = torch.maximum(lo.abs(), hi.abs()).clamp_min(1e-8)
        scales = (2 * amax / 15).half().float()
        zeros = torch.full((n, groups), 8, dtype=torch.int16)
    else:
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
        scales = ((hi - lo).clamp_min(1e-8) / 15).half().float()
        zeros = torch.round(-lo / scales).clamp(*zero_range).to(torch.int16)
    codes = torch.round(w / scales[:, g_idx]) + zeros[:, g_idx]
    return Int4Weight(codes.clamp(0, 15).to(torch.uint8), zeros, scales, g_idx.long())
