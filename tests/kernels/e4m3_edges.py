"""The values at which a conversion to e4m3 (float8_e4m3fn) can go wrong, for the KV-store kernels' tests."""

import torch


def e4m3_edge_values() -> torch.Tensor:
    """Every finite e4m3 value, the midpoints between neighbours (ties: to even), one fp32 ulp either side of
    each midpoint, values past 448 (clamped), and all of them negated."""
    values = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448
    mid = (values[:-1] + values[1:]) / 2
    edges = torch.cat([values, mid, torch.nextafter(mid, torch.zeros_like(mid)),
                       torch.nextafter(mid, torch.full_like(mid, 1e9)), torch.tensor([464.0, 500.0, 1e6])])
    return torch.cat([edges, -edges])


EDGE_FREE_TOKEN = 20  # of kv_with_edges(40, 2, 32, ...): in neither K's edges (tokens 0-15) nor V's (24-39)


def kv_with_edges(tokens: int, heads: int, d: int, k_scale: float, v_scale: float, dtype, seed: int = 3):
    """Random K/V (normal, standard deviation 40) [tokens, heads, d] with the edge values times the scales at the
    start of K and the end of V, so that divided by their scales they land on the edges (exactly, for most
    scales)."""
    edges = e4m3_edge_values()
    assert tokens * heads * d >= len(edges)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(tokens * heads * d, generator=g) * 40
    v = torch.randn(tokens * heads * d, generator=g) * 40
    k[:len(edges)] = edges * k_scale
    v[-len(edges):] = edges * v_scale
    return k.view(tokens, heads, d).to(dtype), v.view(tokens, heads, d).to(dtype)
