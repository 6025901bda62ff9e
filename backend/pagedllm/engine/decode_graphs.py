"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (vLLM's capture sizes).

A pure decode step (every row one token, every row sampled) of n rows runs in the smallest bucket b >= n: its
inputs are copied into static buffers, rows n..b are padding, and the bucket's graph is replayed. A padding
row holds token 0 at position 0, writes its K/V into slot 0 of the null block (block 0, never handed out) and
attends to that one slot, so it touches nothing a real row reads. Other steps (prefills, drafts, LoRA,
length-dependent rope, more rows than the largest bucket) run eagerly as before.

`capture=False` runs the same padded, static-buffer forward eagerly: the path the CPU tests check (padding
changes no real row's logits), and what a step does where no graph was captured.

Why graphs: a decoder layer launches ~10 kernels; at batch 1 on a GPU the step is launch-bound (a 125M
model's weights stream in ~50 µs on an H200, its ~150 launches take longer). A replay launches them all at
once. What a graph needs from the layers: no host reads of device values and no shapes that vary within a
bucket; the Triton attention backend reads only tensors (its grid is rows x KV heads x 1 for a decode).
"""

from __future__ import annotations

import logging
import time

import torch

from pagedllm.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

# vLLM's default capture sizes: 1, 2, 4, then every 8 up to 512 (capped at max_num_seqs, which is added)
DEFAULT_SIZES = (1, 2, 4, *range(8, 513, 8))


def capture_sizes(max_num_seqs: int, requested: list[int] | tuple[int, ...] | None = None) -> tuple[int, ...]:
    """The buckets to capture: the requested sizes (else vLLM's defaults) up to max_num_seqs, which the
    default list also includes so that a full batch replays."""
    if requested is not None:
        return tuple(sorted({s for s in requested if s <= max_num_seqs}))
    return tuple(sorted({s for s in DEFAULT_SIZES if s <= max_num_seqs} | {max_num_seqs}))


def graphs_unsupported(model, backend, device: str, tensor_parallel_size: int) -> str | None:
    """Why decode graphs cannot run for this model and backend (None: they can)."""
    if not device.startswith("cuda"):
        return f"device {device} (CUDA graphs need a GPU)"
    if tensor_parallel_size != 1:
        return "tensor parallelism (not captured yet)"
    if getattr(model, "is_fallback", False):
        return "the transformers fallback"
    if getattr(model, "lora", None) is not None:
        return "LoRA (per-step adapter slots)"
    if getattr(model, "length_dependent_rope", False):
        return "a rope whose frequencies depend on each sequence's length"
    if backend.name != "triton":
        return f"attention backend {backend.name} (only the Triton kernels are capture-safe)"
    from pagedllm.models.layers.moe import FusedMoE

    if any(isinstance(m, FusedMoE) for m in model.modules()):
        return "mixture-of-experts layers (their routing sizes segments on the host)"
    return None


class DecodeGraphs:
    def __init__(self, runner, sizes: tuple[int, ...], max_blocks: int, capture: bool = True) -> None:
        """`runner`: the ModelRunner whose model and KV caches the graphs use; `max_blocks`: the widest block
        table (max_model_len / block_size, rounded up)."""
        if not sizes:
            raise ValueError("DecodeGraphs: no sizes to capture")
        self.runner, self.sizes, self.capture = runner, sizes, capture
        dev, rows = runner.device, max(sizes)
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(rows, max_blocks, dtype=torch.int64, device=dev)
        self.seq_lens = torch.ones(rows, dtype=torch.int64, device=dev)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=dev)
        self._seq_lens_list = [1] * rows  # host copy for backends that read it (eager path only)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    # --- which steps ------------------------------------------------------------------------
    def bucket(self, step) -> int | None:
        """The bucket a step replays in, or None (it runs eagerly)."""
        n = len(step.seq_lens)
        if not n or step.num_decodes != n or len(step.input_ids) != n or len(step.logits_indices) != n:
            return None
        if step.row_lora_slots is not None or step.block_table.shape[1] > self.block_tables.shape[1]:
            return None
        return next((b for b in self.sizes if b >= n), None)

    # --- one step ---------------------------------------------------------------------------
    def run(self, step, bucket: int) -> torch.Tensor:
        """The logits of a pure decode step's rows (a copy: the graph's output is overwritten by the next
        replay)."""
        n = len(step.seq_lens)
        self._load(step, n, bucket)
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            return self.outputs[bucket][:n].clone()
        return self._forward(bucket)[:n]

    def _load(self, step, n: int, bucket: int) -> None:
        width = step.block_table.shape[1]
        self.input_ids[:n].copy_(torch.from_numpy(step.input_ids), non_blocking=True)
        self.positions[:n].copy_(torch.from_numpy(step.positions), non_blocking=True)
        self.slot_mapping[:n].copy_(torch.from_numpy(step.slot_mapping), non_blocking=True)
        self.seq_lens[:n].copy_(torch.tensor(step.seq_lens, dtype=torch.int64), non_blocking=True)
        self.block_tables[:n, :width].copy_(torch.from_numpy(step.block_table), non_blocking=True)
        self.block_tables[:n, width:].zero_()
        if bucket > n:  # padding rows: token 0 at position 0, into and from slot 0 of the null block
            self.input_ids[n:bucket].zero_()
            self.positions[n:bucket].zero_()
            self.slot_mapping[n:bucket].zero_()
            self.seq_lens[n:bucket].fill_(1)
            self.block_tables[n:bucket].zero_()
        self._seq_lens_list = list(step.seq_lens) + [1] * (bucket - n)

    def _forward(self, b: int) -> torch.Tensor:
        runner = self.runner
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], block_tables=self.block_tables[:b], seq_lens=self.seq_lens[:b],
            query_start_loc=list(range(b + 1)), query_start_loc_t=self.query_start_loc[:b + 1], max_query_len=1,
            seq_lens_list=self._seq_lens_list[:b], num_decodes=b, block_size=runner.block_size,
            backend=runner.backend)
        hidden = runner.model(self.input_ids[:b], self.positions[:b], runner.kv_caches, meta)
        return runner.model.compute_logits(hidden)

    # --- capture ----------------------------------------------------------------------------
    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket, largest first into one memory pool, each after an eager warm-up (kernels are
        compiled outside capture); then check each replay against the eager pass on the same probe inputs.
        Any failure drops every graph (steps run eagerly) and is logged with its reason."""
        t0 = time.perf_counter()
        try:
            pool = torch.cuda.graph_pool_handle()
            for b in sorted(self.sizes, reverse=True):
                self._probe(b)
                self._forward(b)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[b] = self._forward(b)
                self.graphs[b] = graph
            for b in self.sizes:
                self._check(b)
        except Exception as e:  # noqa: BLE001 - whatever stops a capture, steps still run eagerly
            logger.warning("decode CUDA graphs: off (%s: %s)", type(e).__name__, e)
            self.graphs.clear()
            self.outputs.clear()
            return
        logger.info("decode CUDA graphs: %d buckets (%s) captured and checked in %.1f s", len(self.graphs),
                    ", ".join(map(str, self.sizes)), time.perf_counter() - t0)

    def _probe(self, b: int) -> None:
        """Padding-row inputs with varied tokens: every row reads and writes only slot 0 of the null block."""
        self.input_ids[:b].copy_(torch.arange(b, device=self.input_ids.device) * 7919 % 1000)
        self.positions[:b].zero_()
        self.slot_mapping[:b].zero_()
        self.seq_lens[:b].fill_(1)
        self.block_tables[:b].zero_()
        self._seq_lens_list = [1] * b

    def _check(self, b: int) -> None:
        self._probe(b)
        self.graphs[b].replay()
        replayed = self.outputs[b].float().clone()
        eager = self._forward(b).float()
        err = (replayed - eager).abs().max().item()
        if not err <= 1e-3 * max(1.0, eager.abs().max().item()):
            raise RuntimeError(f"bucket {b}: the replay's logits differ from the eager pass's by {err:g}")
