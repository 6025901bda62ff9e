"""glibc's malloc told to keep the memory a CPU engine frees, so that a step's large activations are not handed
back to the OS and faulted in again on the next step.

By default glibc serves an allocation above its mmap threshold (at most 32 MiB) with a fresh mmap and unmaps it
on free, and trims the heap's free top above 128 KiB: every prefill chunk's large activations (a 2,048-row chunk's
gate/up output is 40 MB at the 0.5B shape) then cost page faults and zeroing on every step. On the 2-core Intel
AMX host (session 27) the 0.5B shape's linears at 2,048 rows took 175 ms with the default and 124 ms with both
switched off (1.41x; perf/README.md). vLLM's CPU documentation gets the same effect by preloading tcmalloc, which
a library cannot do for its caller's process; mallopt can, once the process runs.

The cost: memory freed after a peak stays with the process (as with tcmalloc), reused by later allocations; until
the heap's free chunks fit what a step asks (aligned allocations of one size can need several rounds) it grows by a
few of the largest activations and then stays (a 125M engine through six generate calls of 8-256 prompts of up to
1,800 tokens: RSS 3,044-3,049 MiB against 3,013-3,017 without, session 27). A process whose C library has no
mallopt (musl, another OS) is left as it is. `cpu_malloc_tuning=False` (engine config) or
PAGEDLLM_CPU_MALLOC_TUNING=0 turns it off for A/B runs; it applies to the whole process, once.
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
_TRIM_NEVER = (1 << 31) - 1  # the largest threshold mallopt takes: a free heap top below 2 GiB is kept

_applied = False


def keep_freed_memory() -> bool:
    """No mmap for large allocations and no trimming of the heap, for this whole process; whether it applies."""
    global _applied
    if _applied:
        return True
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        logger.info("no mallopt in this process's C library: malloc left as it is")
        return False
    _applied = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, _TRIM_NEVER) == 1
    logger.info("malloc: large allocations from the heap, freed memory kept for reuse (%s)",
                "applied" if _applied else "refused")
    return _applied
