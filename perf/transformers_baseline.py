"""transformers' own `generate` as a baseline: static batches with left padding, every prompt to exactly
`max_tokens` new tokens."""

from __future__ import annotations

import time

import torch
from transformers import AutoModelForCausalLM


def run_transformers(path, prompts, max_tokens, dtype, batch_size):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    pad = 2
    generated = 0
    t0 = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
        generated += (out.shape[1] - width) * len(batch)
    return generated, time.perf_counter() - t0
