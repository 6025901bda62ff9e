"""bf16 linear layers on CPU, swapped in after the weights load.

- `PackedLinear`: oneDNN packs the weight once (bit-identical to `F.linear`, 1.6-1.9x faster for M <= 64, equal
  for large batches); for decodes (and up to 512 rows, 1,024 with AMX, where a race at load says it wins: on Zen 4
  it did, on Zen 5 oneDNN leads from 16 rows, linear_race.py) our kernel runs on a second copy of the weight in
  its own tiles: AVX512-BF16 (bf16_tiles.py, 1.07-1.9x as fast as oneDNN at up to 8 rows) or, on CPUs with AMX,
  AMX tiles (amx_linear.py: the 0.5B shape's linears 1.04-1.14x oneDNN at 1-128 rows, 0.95x at 256-512; 125M's
  1.09-1.20x at 256-512 since session 33's chunked passes, 1.33-1.55x at 512-1,024 rows, where oneDNN runs at
  ~1.5-1.6 TFLOP/s and ours at ~2.2-2.3; oneDNN's 2.4 from 1,536 rows leads). The copy doubles the linears' weight
  bytes (125M: +200 MB): the price of decode streaming the weight at the host's bandwidth. (Until session 27 an
  AMX host kept one copy, in AMX tiles, and unpacked it for oneDNN above 128 rows on every call: a 256-row
  decode's linears took 1.65x as long as on oneDNN's packed weight, and the 0.5B model ran 256 sequences at 0.65x
  vLLM.)

oneDNN keeps a primitive per input shape in two caches of 1,024 entries each (ideep's and its own), about
0.55 MiB per entry whatever the weight: a server whose batches take every row count from 1 to 2,048 grew by
hundreds of MiB before they filled (perf/soak.py). So the rows oneDNN sees are rounded up to a few dozen
sizes (`bucket_rows`: 1, 2, 4, 8, then multiples of 8 up to 64, of 16 up to 512 and of 64 above: 63 sizes up to
2,048), padded with zero rows that are dropped from the result; each real row's result does not depend on them.
Padding is not free: oneDNN's time grows with the rows it is given (Zen 5, the 125M model's 48 decoder linears:
147 rows 24.8 ms, 160 rows 26.4, 192 rows 31.2), so one decode row padded to 8 made a 125M layer's linears up to
2.2x slower, and a 147-token prompt padded to 192 (multiples of 64, as above 64 rows until session 19) spent 26%
longer in its linears than at its own size. Each size costs a primitive per weight shape: every row count from 9 to
2,048 through the 125M model's five linear shapes grew a process by 306 MiB with the 42 sizes before, 369 MiB
with these 63 (both far below the caches' 1,024 entries, where growth would stop).

Where oneDNN has no bf16 matmul (AVX2 CPUs without AVX-512, whose reorder raises), `pack_linears` hands the
layers to avx2_linear.py instead.

`pack_linears(model, use_amx=False)` uses the AVX512-BF16 tiles on AMX hosts too (`EngineConfig.amx_linear`, for
A/B runs). Only bf16 is swapped: fp32 is
the path held token-identical to transformers, and oneDNN's packed fp32 path rounds differently from `F.linear`.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pagedllm.models.layers.avx2_linear import use_avx2_linears
from pagedllm.models.layers.linear_race import race_tile_rows

logger = logging.getLogger(__name__)

_BATCH_HINT = 64  # oneDNN picks its blocking for this many rows; other row counts stay correct


def bucket_rows(rows: int) -> int:
    """The row count a batch of `rows` is padded to before oneDNN sees it (see the module's docstring)."""
    if rows <= 8:  # 1, 2, 4, 8: a decode of 1 row padded to 8 took up to 2.2x as long per layer (measured)
        return 1 << (rows - 1).bit_length()
    step = 8 if rows <= 64 else 16 if rows <= 512 else 64
    return -(-rows // step) * step


def padded_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, K], with zero rows appended up to bucket_rows(rows)."""
    rows = x.shape[0]
    target = bucket_rows(rows)
    if target == rows:
        return x
    out = x.new_zeros(target, x.shape[1])
    out[:rows] = x
    return out


def packing_available() -> bool:
    """Whether oneDNN can pack bf16 weights here: it needs AVX512 (BW, VL, DQ) or AVX-NE-CONVERT, which an
    AVX2-only CPU (Zen 3, Haswell to Skylake client parts) lacks; its reorder raises there."""
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_is_mkldnn_bf16_supported") and mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 [out, in] weight packed by oneDNN for packed_matmul."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)


def packed_matmul(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """rows [n, in] @ the packed weight's transpose (+ bias): [n, out], through the bucketed row counts."""
    y = torch.ops.mkldnn._linear_pointwise(padded_rows(rows), packed, bias, "none", [], "")
    return y[:rows.shape[0]]


def _tiles_kernels(use_amx: bool) -> list:
    """Our bf16 kernels for decode-sized batches that this host can run (and that build), in order of preference:
    the AMX one where the host has AMX and `use_amx` (for the weights whose shape it takes), the AVX512-BF16 one."""
    try:
        from pagedllm_kernels.cpu import build

        kernel = build.kernel_module("bf16_tiles")
        if kernel is None:
            return []
        build.extension()
        return [build.kernel_module("amx_linear"), kernel] if use_amx and build.amx_supported()[0] else [kernel]
    except Exception as e:  # no compiler, build failure: oneDNN alone
        logger.info("bf16 linear kernel unavailable (%s); oneDNN takes every batch", e)
        return []


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear, tiles_kernels=()) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", pack_weight(linear.weight))
        self.bias = linear.bias
        # Up to max_tile_rows rows (decodes, and as many more as the race at load gave it), our kernel on a second
        # copy of the weight in its tiles: the first of `tiles_kernels` (bf16_tiles.py, amx_linear.py) that takes it.
        self.tiles_kernel = next((k for k in tiles_kernels if k.can_pack(linear.weight)), None)
        self.max_tile_rows = 0  # the most rows our kernel takes (pack_linears races it; the kernel's MAX_ROWS else)
        self.prefetch = True  # our kernel's software prefetch from 5 rows (pack_linears races it on and off)
        if self.tiles_kernel is not None:
            self.max_tile_rows = self.tiles_kernel.MAX_ROWS
            self.register_buffer("weight_tiles", self.tiles_kernel.pack(linear.weight))
            self.bias_f32 = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        return self.run(rows, rows.shape[0] <= self.max_tile_rows).view(*x.shape[:-1], self.out_features)

    def run(self, rows: torch.Tensor, tile: bool) -> torch.Tensor:
        """rows [n, in] -> [n, out] through our kernel (`tile`, which needs its tiles) or oneDNN."""
        if tile:
            return self.tiles_kernel.linear(rows, self.weight_tiles, self.bias_f32, self.prefetch)
        return packed_matmul(rows, self.packed_weight, self.bias)


def pack_linears(model: nn.Module, use_amx: bool = True) -> int:
    """Replace every bf16 CPU nn.Linear in `model` by a PackedLinear (with the AMX kernel where `use_amx` and the
    host has AMX), or where oneDNN has no bf16 matmul (AVX2 CPUs) by an Avx2Linear: a transform over the model,
    after its weights are loaded. Returns how many were replaced."""
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu"]
    if not packing_available():
        return use_avx2_linears(model, targets)
    kernels = _tiles_kernels(use_amx) if targets else []
    for name, linear in targets:
        model.set_submodule(name, PackedLinear(linear, kernels))
    tiled = [(name, m) for name, m in model.named_modules() if isinstance(m, PackedLinear) and m.tiles_kernel]
    if tiled:
        limit, prefetch, record = race_tile_rows(tiled)
        for _, m in tiled:
            m.max_tile_rows, m.prefetch = limit, prefetch
        names = sorted({m.tiles_kernel.__name__.rsplit(".", 1)[-1] for _, m in tiled})
        logger.info("bf16 linears: our kernel (%s) up to %d rows (software prefetch %s), oneDNN above (raced at load: "
                    "%s)", ", ".join(names), limit, "on" if prefetch else "off", record)
    return len(targets)
