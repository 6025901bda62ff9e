"""One request's grammar state (its backend's matcher) and the per-step bitmask over a batch.

Only the rows of constrained requests are touched: `GrammarMasks` fills their masks and masks their logits in
place before the sampler sees them, so free requests in the same batch keep the
sampler's fast paths. The matcher advances by the tokens
the output processor accepts (one per step: speculative decoding is turned off for constrained requests,
whose drafts nobody would check against the grammar). Preemption keeps the request's output tokens, so its
matcher stays valid through a recompute.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CompiledGrammar:
    """A spec compiled by one backend (guidance_backend.py, xgrammar_backend.py), as GrammarCompiler caches it."""

    backend: str  # "guidance" | "xgrammar"
    vocab_size: int  # the model's vocabulary: the bitmask's width in tokens
    new_matcher: Callable[[], object]  # a fresh matcher: accept(token_id) -> bool, fill(bitmask, row)


class RequestGrammar:
    def __init__(self, compiled: CompiledGrammar) -> None:
        self.matcher = compiled.new_matcher()
        self.vocab_size = compiled.vocab_size

    def accept(self, token_id: int) -> None:
        """Advance by a sampled token; ValueError if the grammar forbids it (the bitmask should have)."""
        if not self.matcher.accept(token_id):
            raise ValueError(f"structured output: token {token_id} does not follow the grammar")


class GrammarMasks:
    """The constrained rows' token masks: filled by their matchers once the forward pass has been launched (on
    a GPU the fill overlaps it; on the CPU it follows it), then applied to the logits in place before sampling.

    Measured on 2 cores (perf/structured_output.py, 19M model, xgrammar): filling on a thread of its own while
    the forward pass runs, or ahead from the end of the previous step, was no faster than filling here
    (0.78-0.81 against 0.80-0.84 of the free batch's speed in interleaved runs): the fill releases the GIL, but
    its thread competes with torch's threads for the cores. xgrammar's batch fill, on one thread or two, was
    slower still (torch's OpenMP workers still spin after the forward pass). The mask itself is applied on
    the CPU by our AVX-512 kernel (pagedllm_kernels.cpu.token_mask) straight from the bitmask, one masked
    store per 32 tokens: ~30 us for 32 rows of a 32k vocabulary, against ~2-4 ms for torch's bit expansion and
    masked fill (its torch reference, still used off the CPU)."""

    def __init__(self, kernel=None) -> None:
        """`kernel`: the token_mask module (None: the torch reference everywhere)."""
        self.kernel = kernel

    @torch.inference_mode()  # the logits are an inference tensor
    def apply(self, logits: torch.Tensor, reqs: list) -> dict[int, Exception]:
        """Mask, in place, the logits rows of `reqs`' constrained requests (row i is reqs[i]; the others are
        untouched). Returns the rows whose matcher failed, with the error: those requests must fail alone."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if not rows:
            return {}
        bitmask, failed = _fill([reqs[i].grammar for i in rows])
        on_cpu = logits.device.type == "cpu" and logits.is_contiguous() and logits.dtype in (torch.float32,
                                                                                           torch.bfloat16)
        if self.kernel is not None and on_cpu:
            self.kernel.mask_logits_(logits, rows, bitmask)
        else:
            from pagedllm_kernels.cpu.token_mask import reference_mask_logits_

            reference_mask_logits_(logits, rows, bitmask.to(logits.device))
        return {rows[j]: err for j, err in failed.items()}


def _fill(grammars: list[RequestGrammar]) -> tuple[torch.Tensor, dict[int, Exception]]:
    """A compact int32 [len(grammars), ceil(vocab / 32)] bitmask, row j for grammars[j] (bit t: token t may
    follow; both backends write this layout), and the rows whose matcher raised."""
    bitmask = torch.full((len(grammars), (grammars[0].vocab_size + 31) // 32), -1, dtype=torch.int32)
    failed = {}
    for j, g in enumerate(grammars):
        try:
            g.matcher.fill(bitmask, j)
        except (ValueError, RuntimeError) as e:
            failed[j] = e
    return bitmask, failed
