"""A request's token-level controls applied to its logits row (vLLM's semantics): its offline
`logits_processors` called in turn, then `logit_bias` added, `allowed_token_ids` the only finite entries, and
`bad_words` banned.

A bad word is a token sequence (the InputProcessor tokenizes each word with and without a leading space, as
vLLM does): its last token is banned whenever the output so far ends with the word's other tokens, so a
single-token word is always banned and a longer one can never be completed.
"""

from __future__ import annotations

import torch

from pagedllm.sampling_params import num_positional_args


def tokenize_bad_words(tokenizer, words: list[str]) -> list[list[int]]:
    out: list[list[int]] = []
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


def apply_token_controls(row: torch.Tensor, req) -> None:
    """Edit one request's logits row in place."""
    p = req.sampling_params
    for fn in p.logits_processors:
        out = list(req.output_token_ids)
        args = (out, row) if num_positional_args(fn) == 2 else (list(req.prompt_token_ids), out, row)
        result = fn(*args)
        if not isinstance(result, torch.Tensor) or result.shape != row.shape:
            raise ValueError(f"logits processor {getattr(fn, '__name__', fn)!r} must return a tensor of shape "
                             f"{tuple(row.shape)}, got {getattr(result, 'shape', type(result).__name__)}")
        if result is not row:
            row.copy_(result)
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
        row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=row.dtype)
    if p.allowed_token_ids is not None:
        keep = row.new_full(row.shape, float("-inf"))
        ids = torch.tensor(p.allowed_token_ids, dtype=torch.long)
        keep[ids] = row[ids]
        row.copy_(keep)
    if req.bad_words_token_ids:
        out = req.output_token_ids
        banned = [w[-1] for w in req.bad_words_token_ids
                  if len(w) == 1 or (len(out) >= len(w) - 1 and out[len(out) - len(w) + 1:] == w[:-1])]
        if banned:
            row[banned] = float("-inf")
