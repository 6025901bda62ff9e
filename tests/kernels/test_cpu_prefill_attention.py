"""The AVX-512 paged attention kernel on rows of several query tokens (whole prompts, chunks after cached
positions) mixed with decode rows, against the token-by-token torch reference: lengths on and around block and
tile boundaries, GQA ratios (tiles of 3 to 64 tokens), block sizes, fp32, bf16 and an fp8 cache, sliding
windows, positions nobody owns poisoned. bf16 prompts run both ways where the CPU has AMX: on AVX-512 and on
the tile unit (attention_amx.h), and so do decodes of 5 or more query heads per KV head."""

import pytest
import torch
from cpu_caches import poison_outside_rows
from pagedllm_kernels.cpu import kv_layout
from pagedllm_kernels.cpu import paged_attention as kernel

supported, why = kernel.cpu_supported()
pytestmark = pytest.mark.skipif(not supported, reason=why)
amx_ok, amx_why = kernel.amx_supported()
ON_AMX = pytest.mark.skipif(not amx_ok, reason=amx_why)
# Prompt tiles (and wide groups' decodes) on AVX-512, or on the AMX tile unit (bf16 queries only).
PATHS = [pytest.param(False, id="avx512"), pytest.param(True, id="amx", marks=ON_AMX)]
DTYPE_PATHS = [pytest.param(torch.float32, False, id="fp32"), pytest.param(torch.bfloat16, False, id="bf16"),
               pytest.param(torch.bfloat16, True, id="bf16-amx", marks=ON_AMX)]

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=0), torch.bfloat16: dict(atol=1e-2, rtol=8e-3)}
FP8_TOLERANCE = dict(atol=2e-2, rtol=8e-3)  # a bf16 query over an e4m3 cache
# (context length, query tokens) per row: decodes, whole prompts (n == len) and chunks after cached positions;
# lengths around 16 (the block size) and 48 / 16 (a tile at 1 and 3 query heads per KV head).
ROWS = [(40, 1), (1, 1), (17, 17), (48, 48), (49, 49), (16, 16), (2, 2), (100, 33), (161, 97), (65, 16), (33, 2)]


def make(heads, kv_heads, head_dim, block_size, dtype, rows=ROWS, seed=0, cache_dtype=None):
    """q for every row's tokens, caches (plain layout) holding each row's context, tables, lens, starts."""
    g = torch.Generator().manual_seed(seed)
    per_row = [-(-n // block_size) for n, _ in rows]
    num_blocks = sum(per_row) + 3
    shape = (num_blocks, block_size, kv_heads, head_dim)
    kc, vc = (torch.randn(*shape, generator=g).to(cache_dtype or dtype) for _ in range(2))
    perm = torch.randperm(num_blocks - 1, generator=g) + 1  # shuffled, never the null block 0
    tables = torch.zeros(len(rows), max(per_row) + 1, dtype=torch.int64)
    used = 0
    for i, n in enumerate(per_row):
        tables[i, :n] = perm[used:used + n]
        used += n
    counts = torch.tensor([t for _, t in rows])
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)])
    q = torch.randn(int(starts[-1]), heads, head_dim, generator=g).to(dtype)
    return q, kc, vc, tables, torch.tensor([n for n, _ in rows]), starts


def attend(q, kc, vc, tables, lens, starts, scale, window=None, k_scale=1.0, v_scale=1.0, amx=False):
    return kernel.paged_attention(q, *kv_layout.to_kernel_layout(kc, vc), tables, lens, scale, window, k_scale,
                                  v_scale, query_start_loc=starts, amx=amx)


@pytest.mark.parametrize("dtype,amx", DTYPE_PATHS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 32), (12, 4, 64), (14, 2, 64), (8, 1, 128),
                                                     (6, 2, 96), (16, 1, 64)])
@pytest.mark.parametrize("block_size", [16, 32, 48, 64])
def test_prompts_chunks_and_decodes_match_the_reference(dtype, amx, heads, kv_heads, head_dim, block_size):
    """(Block size 48 stays on AVX-512 with amx: the tiles take spans of whole 16-, 32- or 64-position blocks.)"""
    q, kc, vc, tables, lens, starts = make(heads, kv_heads, head_dim, block_size, dtype)
    scale = head_dim ** -0.5
    got = attend(q, kc, vc, tables, lens, starts, scale, amx=amx)
    ref = kernel.reference(q, kc, vc, tables, lens, scale, query_start_loc=starts)
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got.float(), ref.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype,amx", DTYPE_PATHS)
def test_the_same_queries_one_token_per_row_give_the_same_outputs(dtype, amx):
    """Tiles (one pass over a block for many tokens) and one row per token compute the same attention."""
    q, kc, vc, tables, lens, starts = make(12, 4, 64, 16, dtype)
    tok_tables, tok_lens = kernel.per_token_rows(tables, lens, starts)
    torch.testing.assert_close(attend(q, kc, vc, tables, lens, starts, 0.125, amx=amx).float(),
                               attend(q, kc, vc, tok_tables, tok_lens, None, 0.125).float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype,amx", DTYPE_PATHS)
@pytest.mark.parametrize("window", [1, 7, 16, 40])
@pytest.mark.parametrize("heads", [8, 14])  # decodes on AVX-512 / on the tile unit with amx
def test_sliding_window(window, dtype, amx, heads):
    """Each token of a tile has its own window start; odd windows start mid token-pair in bf16."""
    q, kc, vc, tables, lens, starts = make(heads, 2, 64, 16, dtype)
    got = attend(q, kc, vc, tables, lens, starts, 0.125, window, amx=amx)
    ref = kernel.reference(q, kc, vc, tables, lens, 0.125, window, query_start_loc=starts)
    torch.testing.assert_close(got.float(), ref.float(), **TOLERANCE[dtype])


@pytest.mark.parametrize("amx", PATHS)
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("heads,kv_heads", [(12, 4), (14, 2)])
def test_an_fp8_cache_with_scales(window, block_size, amx, heads, kv_heads):
    q, kc, vc, tables, lens, starts = make(heads, kv_heads, 64, block_size, torch.bfloat16,
                                           cache_dtype=torch.float8_e4m3fn)
    got = attend(q, kc, vc, tables, lens, starts, 0.125, window, 0.5, 2.0, amx=amx)
    ref = kernel.reference(q, kc, vc, tables, lens, 0.125, window, 0.5, 2.0, query_start_loc=starts)
    torch.testing.assert_close(got.float(), ref.float(), **FP8_TOLERANCE)


@pytest.mark.parametrize("dtype,amx", DTYPE_PATHS)
@pytest.mark.parametrize("block_size", [16, 32, 64])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("heads", [4, 14])
def test_only_each_rows_context_is_read(dtype, amx, block_size, window, heads):
    """NaN in every block no row owns and past each row's length in its last block (which the tiles read as a
    whole) changes no output."""
    q, kc, vc, tables, lens, starts = make(heads, 2, 64, block_size, dtype)
    before = attend(q, kc, vc, tables, lens, starts, 0.125, window, amx=amx)
    poison_outside_rows(kc, vc, tables, lens, block_size)
    torch.testing.assert_close(attend(q, kc, vc, tables, lens, starts, 0.125, window, amx=amx), before)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                               (torch.bfloat16, torch.float8_e4m3fn)])
@pytest.mark.parametrize("block_size", [16, 48, 64])
@pytest.mark.parametrize("window", [None, 300])
def test_prompts_longer_than_a_span_match_the_reference(dtype, cache_dtype, block_size, window):
    """On AVX-512 a tile's pass covers a span of up to 256 positions of several blocks: prompts and a chunk over
    several spans, one a position past two, with windows that start inside a span."""
    rows = [(600, 600), (700, 37), (300, 1), (513, 513)]
    q, kc, vc, tables, lens, starts = make(12, 4, 64, block_size, dtype, rows=rows, cache_dtype=cache_dtype)
    got = attend(q, kc, vc, tables, lens, starts, 0.125, window)
    ref = kernel.reference(q, kc, vc, tables, lens, 0.125, window, query_start_loc=starts)
    tolerance = TOLERANCE[dtype] if cache_dtype is None else FP8_TOLERANCE
    torch.testing.assert_close(got.float(), ref.float(), **tolerance)


@pytest.mark.parametrize("amx", PATHS)
def test_one_long_prompt_is_shared_out_in_tiles(amx):
    """A single 1,000-token prompt (many tiles, few rows) against the reference."""
    q, kc, vc, tables, lens, starts = make(12, 4, 64, 16, torch.bfloat16, rows=[(1000, 1000)])
    got = attend(q, kc, vc, tables, lens, starts, 0.125, amx=amx)
    ref = kernel.reference(q, kc, vc, tables, lens, 0.125, query_start_loc=starts)
    torch.testing.assert_close(got.float(), ref.float(), **TOLERANCE[torch.bfloat16])


@ON_AMX
@pytest.mark.parametrize("heads,kv_heads,decodes_on_tiles", [(12, 4, False), (16, 4, False), (10, 2, True),
                                                             (14, 2, True)])
def test_amx_takes_the_prompts_and_the_wide_groups_decodes(heads, kv_heads, decodes_on_tiles):
    """The tile unit sums in another order than AVX-512: a prompt's outputs differ in some last bits, and so do
    a decode row's from 5 query heads per KV head; below that a decode stays on AVX-512, bit for bit."""
    q, kc, vc, tables, lens, starts = make(heads, kv_heads, 64, 16, torch.bfloat16,
                                           rows=[(40, 1), (300, 300), (64, 1)])
    avx, amx = (attend(q, kc, vc, tables, lens, starts, 0.125, amx=a) for a in (False, True))
    assert not torch.equal(avx[1:-1], amx[1:-1])
    for decode in (0, -1):
        assert torch.equal(avx[decode], amx[decode]) != decodes_on_tiles


@pytest.mark.parametrize("amx", PATHS)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(14, 2, 64), (28, 4, 128), (12, 4, 64)])
def test_a_batch_of_decodes_matches_the_reference(amx, heads, kv_heads, head_dim):
    """A serving step's decode rows (enough of them that the AVX-512 path takes all KV heads an item), their
    contexts 1-300 positions and ending anywhere in a block."""
    rows = [(1 + (37 * i) % 300, 1) for i in range(24)]
    q, kc, vc, tables, lens, starts = make(heads, kv_heads, head_dim, 16, torch.bfloat16, rows=rows)
    scale = head_dim ** -0.5
    got = attend(q, kc, vc, tables, lens, starts, scale, amx=amx)
    ref = kernel.reference(q, kc, vc, tables, lens, scale, query_start_loc=starts)
    torch.testing.assert_close(got.float(), ref.float(), **TOLERANCE[torch.bfloat16])


@pytest.mark.skipif(amx_ok, reason="this CPU has AMX")
def test_amx_is_refused_where_the_cpu_has_none():
    q, kc, vc, tables, lens, starts = make(4, 2, 64, 16, torch.bfloat16)
    with pytest.raises(RuntimeError, match="has none"):
        attend(q, kc, vc, tables, lens, starts, 0.125, amx=True)


def test_the_kernel_refuses_inconsistent_rows():
    q, kc, vc, tables, lens, starts = make(4, 2, 64, 16, torch.float32)
    kc, vc = kv_layout.to_kernel_layout(kc, vc)
    with pytest.raises(ValueError, match="query start"):
        kernel.paged_attention(q, kc, vc, tables, lens, 0.125, query_start_loc=starts[:-1])
    with pytest.raises(RuntimeError, match="from 0 to the token count"):
        kernel.paged_attention(q[:-1], kc, vc, tables, lens, 0.125, query_start_loc=starts)
    short = lens.clone()
    short[2] = 3  # a row of 17 query tokens cannot have a context of 3
    with pytest.raises(RuntimeError, match="query tokens for a context of 3"):
        kernel.paged_attention(q, kc, vc, tables, short, 0.125, query_start_loc=starts)
    with pytest.raises(RuntimeError, match="more blocks"):
        kernel.paged_attention(q, kc, vc, tables[:, :2], lens, 0.125, query_start_loc=starts)
