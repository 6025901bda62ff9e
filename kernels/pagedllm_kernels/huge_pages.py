"""Large CPU buffers on transparent huge pages (2 MiB), where the OS offers them.

A decode step streams every weight once and reads each sequence's KV blocks wherever the pool put them: on 4 KiB
pages that is a TLB miss every 4 KiB, and a page walk before each scattered block. Linux's THP in "madvise" mode
(the common default) backs a range with huge pages only if it was advised MADV_HUGEPAGE before it was first
touched, and torch's allocator advises nothing unless THP_MEM_ALLOC_ENABLE was set before its first allocation
(which a library cannot arrange: the caller may have imported torch already). So the big buffers the kernels
stream (the bf16 / fp8 / int4 weight tiles, the KV cache) are allocated here: 2 MiB more than needed, cut at a
2 MiB boundary, advised, then written. Where madvise is missing or refused (THP "never", another OS), they are
plain allocations and nothing else changes.

Measured on the 2-core Zen 5 host, two processes alternated step by step (0.5B shapes, batch 1, against 4 KiB
pages; perf/README.md, session 22): one 2,100-token context's attention over 24 layers 1.24x with its blocks
scattered, 0.96-1.05x with them consecutive; the model's linears 0.94-1.03x (within the host's noise).
"""

from __future__ import annotations

import math
import mmap

import torch

__all__ = ["HUGE_PAGE", "copy_of", "empty", "zeros"]

HUGE_PAGE = 2 << 20
_MIN_BYTES = 2 * HUGE_PAGE  # below this, at most one whole huge page to gain for up to 2 MiB of address space


def empty(shape, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """An uninitialised tensor; on the CPU, from `_MIN_BYTES` up, starting at a 2 MiB boundary with its whole
    2 MiB pages advised as huge pages (they become huge when first written).

    The memory is a fresh anonymous mapping of its own, not torch's allocator's: glibc serves large requests from
    recycled heap memory too, already backed by 4 KiB pages, which advice no longer changes. The tensor holds the
    mapping; it is unmapped when the last view of it goes."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes < _MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype, device=device)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # anonymous: fd -1 (shared would be shmem)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes - nbytes % HUGE_PAGE)
    except OSError:  # THP "never", or a kernel without it: 4 KiB pages
        pass
    return raw[start:start + nbytes].view(dtype).view(shape)


def zeros(shape, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """As `empty`, written with zeros (every page resident from the start)."""
    return empty(shape, dtype, device).zero_()


def copy_of(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of `t` (any view), allocated as `empty` allocates."""
    return empty(t.shape, t.dtype, t.device).copy_(t)
