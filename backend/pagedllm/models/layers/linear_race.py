"""Where our bf16 kernel hands over to oneDNN, raced once at load on the model's own layer shapes.

The crossover is a property of the CPU, not of the kernel alone. On the 2-core Zen 4 host ours led oneDNN's packed
matmul at every row count up to 256 (1.04-1.9x); on the 2-core Zen 5 host it led up to 8 rows (1.07-1.3x) and
trailed from 16 to 128 (0.85-0.98x) until its weight streams were prefetched in software from 5 rows, after which
it led up to 512 (1.01-1.18x; perf/bf16_linear.py, both hosts). That prefetch had slowed an earlier version on
Zen 4, so it is raced first: on and off at 8 and 16 rows, the faster kept for every row count. Up to
`ALWAYS_OURS` rows (decodes, where streaming the weight at the host's bandwidth decides and ours won on both) our
kernel runs without a race against oneDNN; above, each row count of `RACE_ROWS` is timed over the model's first
linears in order, each its own weight, `RACE_BYTES` of them so they stream from memory as in a forward pass (one
layer's, hot in cache, favoured ours at every count on Zen 5), best of a few calls, both paths in turn. Our kernel
keeps the rows up to the last count it won with no loss below it; oneDNN takes every batch above that. A loss is
timed again, both paths in turn, before it stands: a moment's noise on the host at 32 or 64 rows (where ours led
by 7-15%) had cost a 64-sequence decode step ~15% (125M, Zen 5: 2 of ~15 loads in one session), because until
session 30 the limit also decided which steps the C++ decoder loop took (decoder_loop.py; it now takes them all).
"""

from __future__ import annotations

import time

import torch

ALWAYS_OURS = 8
PREFETCH_RACE_ROWS = (8, 16)  # our kernel's software prefetch on and off, each timed at these batches together
RACE_ROWS = (16, 32, 64, 128, 256, 512, 1024)  # those up to the layers' kernel's ceiling (its MAX_ROWS) are raced
RACE_BYTES = 64 << 20  # twice the 2-core hosts' L3
MAX_CALL_S = 0.1  # a call slower than this (a large model) ends the race: the limit stays where it is
LOSS_RETIMES = 2  # times a loss is timed again (both paths, best of all) before it ends the race


def race_tile_rows(named: list[tuple[str, object]], repeats: int = 2) -> tuple[int, bool, list[dict]]:
    """`named`: (name, PackedLinear with our kernel's tiles) in module order. Returns the largest row count our
    kernel should take, whether its software prefetch should be on, and each race point's timings (ms). The LM
    head is left out: it sees a decode's few rows."""
    layers, total = [], 0
    for name, m in named:
        if not name.endswith("lm_head") and total < RACE_BYTES:
            layers.append(m)
            total += m.weight_tiles.numel() * m.weight_tiles.element_size()
    layers = layers or [m for _, m in named]
    limit, record = ALWAYS_OURS, []
    with torch.inference_mode():
        prefetch = True
        if any(m.tiles_kernel.PREFETCH_SWITCH for m in layers):  # (the AMX kernel has no such switch)
            prefetch = _race_prefetch(layers, repeats, record)
        for rows in (r for r in RACE_ROWS if r <= layers[0].max_tile_rows):
            xs = _inputs(layers, rows)
            ours, theirs = _time(layers, xs, tile=True, repeats=repeats), _time(layers, xs, tile=False,
                                                                               repeats=repeats)
            for _ in range(LOSS_RETIMES):
                if ours <= theirs or ours > MAX_CALL_S:
                    break
                ours = min(ours, _time(layers, xs, tile=True, repeats=repeats))
                theirs = min(theirs, _time(layers, xs, tile=False, repeats=repeats))
            record.append({"rows": rows, "ours_ms": round(1e3 * ours, 3), "onednn_ms": round(1e3 * theirs, 3)})
            if ours > theirs:
                break
            limit = rows
            if ours > MAX_CALL_S:
                break
    return limit, prefetch, record


def _race_prefetch(layers: list, repeats: int, record: list) -> bool:
    """Whether our kernel's software prefetch should be on: timed at a decode's 8 rows and at 16, where it differs
    more (Zen 5: 1.1x and 1.35x), on and off alternated so that a drifting host favours neither."""
    batches = [_inputs(layers, rows) for rows in PREFETCH_RACE_ROWS]
    timed = {}
    for prefetch in (True, False, True, False):
        for m in layers:
            m.prefetch = prefetch
        timed.setdefault(prefetch, []).append(sum(_time(layers, xs, tile=True, repeats=repeats) for xs in batches))
    prefetch = min(timed[True]) <= min(timed[False])
    for m in layers:
        m.prefetch = prefetch
    record.append({"rows": PREFETCH_RACE_ROWS, "prefetch_ms": round(1e3 * min(timed[True]), 3),
                   "no_prefetch_ms": round(1e3 * min(timed[False]), 3)})
    return prefetch


def _inputs(layers: list, rows: int) -> dict[int, torch.Tensor]:
    """A random bf16 batch of `rows` per input width of the layers."""
    return {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in {m.in_features for m in layers}}


def _time(layers: list, xs: dict, tile: bool, repeats: int) -> float:
    best = float("inf")
    for i in range(repeats + 1):  # the first call builds oneDNN's primitive for the shape: not timed
        start = time.perf_counter()
        for m in layers:
            m.run(xs[m.in_features], tile)
        if i:
            best = min(best, time.perf_counter() - start)
    return best
