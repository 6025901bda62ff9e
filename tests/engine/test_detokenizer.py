"""Incremental detokenization: the deltas concatenate to the full decode, through the fast tokenizer's Rust
decoder and through the plain `decode` alike, multi-byte characters split over tokens included."""

import random

from pagedllm.engine.detokenizer import IncrementalDetokenizer
from transformers import AutoTokenizer


class WrapperOnly:
    """A tokenizer with only the public `decode` (no Rust backend to call directly)."""

    def __init__(self, tok) -> None:
        self.tok = tok

    def decode(self, ids, **kwargs):
        return self.tok.decode(ids, **kwargs)


def deltas(tokenizer, prompt, generated):
    detok = IncrementalDetokenizer(tokenizer, prompt)
    out = [detok.add(t) for t in generated]
    return out + [detok.flush()]


def test_deltas_add_up_to_the_full_text_with_either_decoder(llama_dir):
    tok = AutoTokenizer.from_pretrained(llama_dir)
    assert tok.backend_tokenizer is not None  # the fast path is the one under test
    text = "naïve café — 日本語のテキスト, emoji 🙂🙃 and plain words"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    rng = random.Random(0)
    generated = ids + [rng.randrange(len(tok)) for _ in range(40)]
    prompt = tok("Once upon a time", add_special_tokens=False)["input_ids"]
    fast, slow = deltas(tok, prompt, generated), deltas(WrapperOnly(tok), prompt, generated)
    assert fast == slow
    full = tok.decode(prompt + generated, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    context = tok.decode(prompt, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    assert "".join(fast) == full[len(context):]
