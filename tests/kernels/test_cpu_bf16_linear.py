"""Our AVX512-BF16 dense linear for decode-sized batches (bf16_tiles.py) against an fp32 reference: row
counts on both sides of its 8-row block, column counts that leave runs of tiles short, bias, strided rows, its
packing's round trip and refusals."""

import pytest
import torch
from pagedllm_kernels.cpu import bf16_tiles

supported, why = bf16_tiles.cpu_supported()
pytestmark = pytest.mark.skipif(not supported, reason=why)


# 16, 96 and 112 columns: 1, 6 and 7 tiles (a run of 4 tiles and its remainder, taken 4, 2 or 1 at a time)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 17, 64])
@pytest.mark.parametrize("n", [16, 96, 112])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_the_reference(rows, n, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(n, 160, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(rows, 160, generator=g).to(torch.bfloat16)
    packed = bf16_tiles.pack(w)
    got = bf16_tiles.linear(x, packed, b)
    want = (x.float() @ w.float().t() + (b if bias else 0)).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=1e-2)
    torch.testing.assert_close(bf16_tiles.reference(x, packed, b), want)


@pytest.mark.parametrize("rows", [1, 4, 5, 8, 9, 17, 64])
def test_the_prefetch_changes_no_result(rows):
    """With or without the software prefetch (the load-time race's choice) the arithmetic is the same."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(112, 96, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    packed = bf16_tiles.pack(w)
    assert torch.equal(bf16_tiles.linear(x, packed, prefetch=True), bf16_tiles.linear(x, packed, prefetch=False))


@pytest.mark.parametrize("threads", [1, 3, 5, 16])
@pytest.mark.parametrize("rows", [1, 5, 8])
def test_every_tile_is_computed_once_whatever_the_thread_count(threads, rows):
    """A batch of up to 8 rows is cut into one run of tiles per thread, at whole passes (4 tiles, or 3 from 5
    rows): 56 tiles (0.5B's o and down projections) over thread counts that leave runs uneven or empty."""
    g = torch.Generator().manual_seed(threads)
    w = torch.randn(896, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
    packed = bf16_tiles.pack(w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = bf16_tiles.linear(x, packed)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got.float(), bf16_tiles.reference(x, packed, None).float(), atol=0.05, rtol=1e-2)


def test_strided_rows_are_read_as_they_are():
    w = torch.randn(32, 64).to(torch.bfloat16)
    wide = torch.randn(3, 128).to(torch.bfloat16)
    x = wide[:, :64]  # a view: rows 128 apart
    assert not x.is_contiguous()
    packed = bf16_tiles.pack(w)
    torch.testing.assert_close(bf16_tiles.linear(x, packed), bf16_tiles.linear(x.contiguous(), packed))


def test_refusals():
    with pytest.raises(ValueError, match="N % 16"):
        bf16_tiles.pack(torch.zeros(24, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="does not fit"):
        bf16_tiles.linear(torch.zeros(1, 32, dtype=torch.bfloat16), bf16_tiles.pack(torch.zeros(16, 64, dtype=torch.bfloat16)))
