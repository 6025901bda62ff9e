"""Token-level controls, each shown by its effect on the tiny model's outputs: logit_bias, allowed_token_ids,
bad_words, include_stop_str_in_output; and refused when out of range."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_all_blocks_free
from pagedllm import LLM, SamplingParams
from pagedllm.engine.logits_controls import tokenize_bad_words

PROMPT = "def fibonacci(n):\n"


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 24)


def run(llm, **params):
    params = {"max_tokens": 16, "ignore_eos": True, **params}
    return llm.generate(PROMPT, SamplingParams(**params), use_tqdm=False)[0].outputs[0]


def test_logit_bias_moves_greedy_choices(llm):
    base = run(llm, temperature=0)
    pushed = run(llm, temperature=0, logit_bias={"77": 100})  # string keys, as OpenAI sends them
    assert pushed.token_ids == [77] * 16
    pulled = run(llm, temperature=0, logit_bias={base.token_ids[0]: -100})
    assert pulled.token_ids[0] != base.token_ids[0]


def test_allowed_token_ids_bound_sampled_tokens(llm):
    allowed = [10, 20, 30, 40]
    out = run(llm, temperature=1.5, seed=1, allowed_token_ids=allowed, max_tokens=32)
    assert set(out.token_ids) <= set(allowed) and len(set(out.token_ids)) > 1


def test_bad_words_never_appear(llm):
    base = run(llm, temperature=0, max_tokens=24)
    word = llm.get_tokenizer().decode(base.token_ids[2:4]).strip()  # a word the greedy output contains
    assert word
    out = run(llm, temperature=0, max_tokens=24, bad_words=[word])
    assert out.token_ids != base.token_ids
    for seq in tokenize_bad_words(llm.get_tokenizer(), [word]):
        n = len(seq)
        assert all(out.token_ids[i:i + n] != seq for i in range(len(out.token_ids) - n + 1)), (seq, out.token_ids)


def test_include_stop_str_in_output(llm):
    base = run(llm, temperature=0, max_tokens=32)
    stop = base.text[5:8]
    assert stop and stop in base.text
    cut = base.text.index(stop)
    without = run(llm, temperature=0, max_tokens=32, stop=[stop])
    with_it = run(llm, temperature=0, max_tokens=32, stop=[stop], include_stop_str_in_output=True)
    assert without.text == base.text[:cut] and with_it.text == base.text[:cut] + stop
    assert with_it.finish_reason == without.finish_reason == "stop"


@pytest.mark.parametrize("params, message", [
    ({"logit_bias": {5: 101}}, "logit_bias: must map token ids to numbers in [-100, 100]"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {99999: 1}}, "logit_bias: [99999] not token ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids: must be a non-empty list"),
    ({"allowed_token_ids": [1, 5000]}, "allowed_token_ids: [5000] not token ids"),
    ({"bad_words": [""]}, "bad_words: must be non-empty strings"),
])
def test_bad_values_are_refused(llm, params, message):
    with pytest.raises(ValueError) as e:
        llm.generate(PROMPT, SamplingParams(**params), use_tqdm=False)
    assert message in str(e.value)
    assert_all_blocks_free(llm)


def test_logits_processors_edit_the_row_each_step(llm):
    """vLLM's per-request processors, both signatures: each sees the output so far (and the prompt)."""
    seen = []

    def only_even(output_ids, logits):
        seen.append(list(output_ids))
        logits[1::2] = float("-inf")
        return logits

    def echo_prompt(prompt_ids, output_ids, logits):  # forces the prompt back, token by token
        forced = torch.full_like(logits, float("-inf"))
        forced[prompt_ids[len(output_ids) % len(prompt_ids)]] = 0.0
        return forced

    out = run(llm, temperature=1.0, seed=3, logits_processors=[only_even])
    assert all(t % 2 == 0 for t in out.token_ids)
    assert seen == [out.token_ids[:i] for i in range(16)]
    prompt_ids = llm.get_tokenizer().encode(PROMPT)
    out = run(llm, temperature=0, logits_processors=[echo_prompt], max_tokens=len(prompt_ids))
    assert out.token_ids == prompt_ids


def test_a_failing_logits_processor_fails_its_request_alone(llm):
    def broken(output_ids, logits):
        return logits[:10]  # the wrong shape

    good = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([PROMPT, PROMPT], [SamplingParams(temperature=0, max_tokens=8, logits_processors=[broken]),
                                           good], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "must return a tensor of shape" in outs[0].error
    assert outs[1].outputs[0].token_ids == run(llm, temperature=0, max_tokens=8).token_ids
    with pytest.raises(ValueError, match="logits_processors"):
        SamplingParams(logits_processors=[lambda logits: logits])
    assert_all_blocks_free(llm)
