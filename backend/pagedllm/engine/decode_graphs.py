"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (vLLM's capture sizes).

A pure decode step (every row one token, every row sampled) of n rows runs in the smallest bucket b >= n: its
inputs are copied into static buffers, rows n..b are padding, and the bucket's graph is replayed. The graph
ends at the final hidden states (the LM head runs after the replay, on the n real rows only, so the pool
holds no [bucket, vocab] logits). A padding row holds token 0 at position 0, writes nothing (slot -1, which
every KV store skips) and attends to slot 0 of the null block (block 0, never handed out), so it touches
nothing a real row reads. Other steps (prefills, drafts, LoRA, length-dependent rope, more rows than the
largest bucket) run eagerly as before.

Before `capture_all` (and where it failed) `run` is the same padded, static-buffer forward run eagerly: the
path the CPU tests check (padding changes no real row's logits).

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
    from pagedllm.models.layers.fp8_linear import Fp8Linear
    from pagedllm.models.layers.moe import FusedMoE

    if any(isinstance(m, FusedMoE) for m in model.modules()):
        return "mixture-of-experts layers (their routing sizes segments on the host)"
    if any(isinstance(m, Fp8Linear) and m.config.activations == "dynamic" for m in model.modules()):
        return "FP8 activations scaled per tensor (padding rows would change the scale)"
    return None


class DecodeGraphs:
    def __init__(self, runner, sizes: tuple[int, ...], max_model_len: int) -> None:
        """`runner`: the ModelRunner whose model and KV caches the graphs use."""
        if not sizes:
            raise ValueError("DecodeGraphs: no sizes to capture")
        self.runner, self.sizes, self.max_model_len = runner, sizes, max_model_len
        dev, rows = runner.device, max(sizes)
        max_blocks = -(-max_model_len // runner.block_size)  # the widest block table
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
        n = len(step.seq_lens)  # (LoRA and rope lengths never reach here: graphs_unsupported)
        if not n or step.num_decodes != n or len(step.logits_indices) != n:
            return None
        if step.block_table.shape[1] > self.block_tables.shape[1]:
            return None
        return next((b for b in self.sizes if b >= n), None)

    # --- one step ---------------------------------------------------------------------------
    def run(self, step, bucket: int) -> torch.Tensor:
        """The logits of a pure decode step's rows (the LM head reads the replay's hidden states before the next
        replay overwrites them)."""
        n = len(step.seq_lens)
        self._load(step, n, bucket)
        if bucket in self.graphs:
            with self._on_device():
                self.graphs[bucket].replay()
            hidden = self.outputs[bucket][:n]
        else:
            hidden = self._forward(bucket)[:n]
        return self.runner.model.compute_logits(hidden)

    def _on_device(self):
        """The runner's GPU as the current device: a graph captured or replayed on another device's stream
        would record nothing of this model (an engine on cuda:N need not have set its device)."""
        return torch.cuda.device(self.runner.device)

    def _load(self, step, n: int, bucket: int) -> None:
        width = step.block_table.shape[1]
        self.input_ids[:n].copy_(torch.from_numpy(step.input_ids), non_blocking=True)
        self.positions[:n].copy_(torch.from_numpy(step.positions), non_blocking=True)
        self.slot_mapping[:n].copy_(torch.from_numpy(step.slot_mapping), non_blocking=True)
        self.seq_lens[:n].copy_(torch.tensor(step.seq_lens, dtype=torch.int64), non_blocking=True)
        self.block_tables[:n, :width].copy_(torch.from_numpy(step.block_table), non_blocking=True)
        self.block_tables[:n, width:].zero_()
        if bucket > n:  # padding rows: token 0 at position 0, stored nowhere, reading the null block's slot 0
            self.input_ids[n:bucket].zero_()
            self.positions[n:bucket].zero_()
            self.slot_mapping[n:bucket].fill_(-1)
            self.seq_lens[n:bucket].fill_(1)
            self.block_tables[n:bucket].zero_()
        self._seq_lens_list = list(step.seq_lens) + [1] * (bucket - n)

    def _forward(self, b: int) -> torch.Tensor:
        """The final hidden states of the first b rows of the static buffers."""
        runner = self.runner
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], block_tables=self.block_tables[:b], seq_lens=self.seq_lens[:b],
            query_start_loc=list(range(b + 1)), query_start_loc_t=self.query_start_loc[:b + 1], max_query_len=1,
            seq_lens_list=self._seq_lens_list[:b], num_decodes=b, block_size=runner.block_size,
            backend=runner.backend)
        return runner.model(self.input_ids[:b], self.positions[:b], runner.kv_caches, meta)

    # --- capture ----------------------------------------------------------------------------
    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket, largest first into one memory pool, each after an eager warm-up (kernels are
        compiled outside capture); then check each replay against the eager pass on probe inputs unlike the
        capture's. Any failure drops every graph (steps run eagerly) and is logged with its reason."""
        t0 = time.perf_counter()
        try:
            with self._on_device():
                pool = torch.cuda.graph_pool_handle()
                for b in sorted(self.sizes, reverse=True):
                    self._probe(b, seed=0)
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

    def _probe(self, b: int, seed: int) -> None:
        """Probe inputs that store nothing (slot -1) and read only the null block, which holds whatever earlier
        probes left there (never written here), over contexts up to the widest block table: each row attends to
        `seq_len` copies of it, at position seq_len - 1, with its own token."""
        g = torch.Generator().manual_seed(seed)
        lens = torch.randint(1, self.max_model_len + 1, (b,), generator=g)
        self.input_ids[:b].copy_(torch.randint(0, 1000, (b,), generator=g))
        self.positions[:b].copy_(lens - 1)
        self.seq_lens[:b].copy_(lens)
        self.slot_mapping[:b].fill_(-1)
        self.block_tables[:b].zero_()
        self._seq_lens_list = lens.tolist() + self._seq_lens_list[b:]

    def _check(self, b: int) -> None:
        """The replay on new inputs against the eager pass on the same ones (a graph that recorded nothing, or
        baked a value in, fails here)."""
        self._probe(b, seed=1 + b)
        self.graphs[b].replay()
        replayed = self.outputs[b].float().clone()
        eager = self._forward(b).float()
        err = (replayed - eager).abs().max().item()
        if not err <= 1e-3 * max(1.0, eager.abs().max().item()):
            raise RuntimeError(f"bucket {b}: the replay's hidden states differ from the eager pass's by {err:g}")
