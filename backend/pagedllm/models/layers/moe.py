"""A fused mixture-of-experts layer: top-k routing, then every expert's gate/up and down projections over the
tokens sorted by expert, and the weighted results added back per token.

- GPU: one grouped matmul per projection, our Triton segmented matmul (kernels/lora_sgmv.py: each expert's rows
  are one segment; tested under the interpreter). No Python loop over experts.
- CPU, bf16: each expert's weights packed for oneDNN once loaded (`pack_experts`), and the experts run one
  after another on their rows (a loop over experts, never over tokens): 1.2-1.4x the model's decode tokens/s
  of torch._grouped_mm, which read the weights at ~9 GB/s (perf/README).
- CPU otherwise (fp32, the path held to transformers): torch._grouped_mm.

    probs = softmax(router(x)) (fp32); w, e = topk(probs, k); w /= sum(w) if renormalize
    y[t] = sum_j w[t, j] * down_e(act(gate_e(x[t])) * up_e(x[t]))      e = e[t, j]

Weights are stored K-major for the grouped matmul: gate_up [experts, hidden, 2 * inter] (gate columns first),
down [experts, inter, hidden]. Each expert's checkpoint tensors load into their slices (`load_weight` with
shard (expert, part)); with tensor parallelism each rank keeps its rows of every expert's intermediate size and
the partial outputs are summed across ranks. `expert_tokens` counts the tokens routed to each expert (metrics).
"""

from __future__ import annotations

import torch
from torch import nn


class FusedMoE(nn.Module):
    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, renormalize: bool,
                 weights_in_model_dtype: bool, act, triton: bool | None = None) -> None:
        """`weights_in_model_dtype`: the routing weights are cast to the model's dtype before they multiply
        (the Qwen MoE families) rather than kept in fp32 (Mixtral). `triton`: the grouped matmuls through our
        Triton kernel (default: on a GPU)."""
        super().__init__()
        self.triton = triton
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.weights_in_model_dtype, self.act = weights_in_model_dtype, act
        self.inter, self.inter_start, self.full_inter = inter, 0, inter  # this rank's rows of each expert
        self.group = None  # tensor parallelism: the partial outputs are all-reduced
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router
        self.packed = None  # bf16 on CPU: per expert (gate_up, down) packed for oneDNN (pack)
        self.w_gate_up = nn.Parameter(torch.empty(num_experts, hidden, 2 * inter), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(num_experts, inter, hidden), requires_grad=False)
        self.register_buffer("expert_tokens", torch.zeros(num_experts, dtype=torch.long), persistent=False)
        # every (expert, part) a checkpoint must provide, per parameter (models/loader.py checks them)
        self.checkpoint_shards = {"w_gate_up": [(e, p) for e in range(num_experts) for p in (0, 1)],
                                  "w_down": [(e, 0) for e in range(num_experts)]}

    def shard(self, rank: int, world_size: int, group) -> None:
        """Keep this rank's 1/world_size of every expert's intermediate rows (before the weights load)."""
        self.inter = self.full_inter // world_size
        self.inter_start, self.group = rank * self.inter, group
        e, hidden = self.num_experts, self.w_down.shape[2]
        self.w_gate_up = nn.Parameter(torch.empty(e, hidden, 2 * self.inter), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(e, self.inter, hidden), requires_grad=False)

    def load_weight(self, param: nn.Parameter, shard, ckpt) -> None:
        """`shard` = (expert, part): part 0 gate, 1 up (of w_gate_up), 0 down; `ckpt` the expert's HF tensor."""
        expert, part = shard
        rows = slice(self.inter_start, self.inter_start + self.inter)
        if param is self.w_down:  # checkpoint [hidden, inter]
            param.data[expert].copy_(ckpt[:, rows].t())
        else:  # checkpoint [inter, hidden]
            at = part * self.inter
            param.data[expert, :, at:at + self.inter].copy_(ckpt[rows].t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_model_dtype:
            weights = weights.to(x.dtype)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # by expert, tokens in order within each
        counts = torch.bincount(flat, minlength=self.num_experts)
        self.expert_tokens += counts
        tokens = order // self.top_k
        if self.packed is not None:
            out = self._experts_packed(x[tokens], counts)
        else:
            offsets = torch.cumsum(counts, 0).to(torch.int32)
            h = self._grouped(x[tokens], self.w_gate_up, counts, offsets)
            gate, up = h.split(self.inter, dim=-1)
            out = self._grouped(self.act(gate) * up, self.w_down, counts, offsets)
        out = (out * weights.flatten()[order].unsqueeze(-1)).to(x.dtype)
        y = torch.zeros_like(x).index_add_(0, tokens, out)
        return y if self.group is None else self.group.all_reduce(y)

    def pack(self) -> None:
        """bf16 on the CPU, once the weights are loaded: each expert's two projections packed for oneDNN (as
        PackedLinear packs a linear), replacing the grouped matmul's weights (not kept twice)."""
        from pagedllm.models.layers.packed_linear import pack_weight

        self.packed = [(pack_weight(self.w_gate_up[e].t().contiguous()), pack_weight(self.w_down[e].t().contiguous()))
                       for e in range(self.num_experts)]
        self.w_gate_up = nn.Parameter(torch.empty(0, dtype=self.w_gate_up.dtype), requires_grad=False)
        self.w_down = nn.Parameter(torch.empty(0, dtype=self.w_down.dtype), requires_grad=False)

    def _experts_packed(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows (sorted by expert, counts[e] each) through each expert's gate/up, activation and down, expert
        by expert on the packed weights. At decode an expert sees a few rows and the layer is bound by reading
        its weights: oneDNN's packed path read them ~1.4x as fast as torch._grouped_mm (a Mixtral-shaped
        layer's gate/up, 23 MB, for 32 tokens: 2.3 against 2.5-3.3 ms)."""
        from pagedllm.models.layers.packed_linear import packed_matmul

        out = torch.empty_like(rows)  # each expert maps hidden -> hidden
        start = 0
        for e, count in enumerate(counts.tolist()):
            if count:
                gate_up, down = self.packed[e]
                h = packed_matmul(rows[start:start + count], gate_up)
                gate, up = h.split(self.inter, dim=-1)
                out[start:start + count] = packed_matmul(self.act(gate) * up, down)
            start += count
        return out

    def _grouped(self, rows: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, offsets: torch.Tensor):
        """rows (sorted by expert, counts[e] each) @ w[e], expert by expert."""
        if not (rows.is_cuda if self.triton is None else self.triton):
            return torch._grouped_mm(rows, w, offs=offsets)
        from pagedllm_kernels.lora_sgmv import sgmv

        starts = (offsets - counts).long()
        experts = torch.arange(self.num_experts, device=rows.device)
        out = rows.new_empty(rows.shape[0], w.shape[2])
        return sgmv(rows, w, out, starts, counts, experts, int(counts.max()), accumulate=False)


def pack_experts(model: nn.Module) -> int:
    """Pack the experts of every bf16 CPU FusedMoE in `model` for oneDNN (FusedMoE.pack), once the weights are
    loaded; returns how many layers were packed."""
    from pagedllm.models.layers.packed_linear import packing_available

    if not packing_available():
        return 0
    layers = [m for m in model.modules() if isinstance(m, FusedMoE) and m.packed is None
              and m.w_down.dtype == torch.bfloat16 and m.w_down.device.type == "cpu"]
    for layer in layers:
        layer.pack()
    return len(layers)
