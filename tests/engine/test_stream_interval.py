"""stream_interval (vLLM's): a streamed request's outputs come every N tokens, its first at once and its last at
the end; the engine's interval is the least any request gets. The tokens and text are the same as without it."""

import itertools

import pytest

from conftest import assert_all_blocks_free, random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import RequestOutputKind

MAX_TOKENS = 22


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 24)


@pytest.fixture(scope="module")
def llm_every_3(llama_dir):
    return LLM(llama_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 24, stream_interval=3)


def stream(llm, prompt, kind=RequestOutputKind.DELTA, n=1, **kw) -> dict[int, list]:
    """Each sample's outputs in order, as (tokens the output carries, its text, finished)."""
    params = SamplingParams(output_kind=kind, n=n, seed=4, temperature=0.0 if n == 1 else 1.0,
                            max_tokens=MAX_TOKENS, ignore_eos=True, **kw)
    llm.engine.add_request({"prompt_token_ids": prompt}, params, request_id="s")
    outputs: dict[int, list] = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            for c in out.outputs:
                outputs.setdefault(c.index, []).append((c.token_ids, c.text, out.finished))
    assert_all_blocks_free(llm)
    return outputs


def expected(llm, prompt, n=1) -> list:
    params = SamplingParams(n=n, seed=4, temperature=0.0 if n == 1 else 1.0, max_tokens=MAX_TOKENS,
                            ignore_eos=True)
    return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs


def boundaries(outputs: list) -> list[int]:
    """Output tokens handed out by the end of each output."""
    return list(itertools.accumulate(len(tokens) for tokens, _, _ in outputs))


@pytest.mark.parametrize("interval", [1, 4, 5])
def test_a_requests_interval_spaces_its_outputs_and_keeps_its_tokens(llm, interval):
    prompt = random_prompts([19], seed=2)[0]
    whole = expected(llm, prompt)[0]
    # Token ids only: an output each time the interval allows (with text, one whose new tokens end mid-character
    # waits for the next token). The first token at once, then every `interval`, the rest with the last output.
    ids = stream(llm, prompt, stream_interval=interval, detokenize=False)[0]
    want = list(range(1, MAX_TOKENS, interval)) + [MAX_TOKENS]
    assert boundaries(ids) == want
    assert [f for _, _, f in ids] == [False] * (len(want) - 1) + [True]
    assert sum((tokens for tokens, _, _ in ids), []) == whole.token_ids
    texts = stream(llm, prompt, stream_interval=interval)[0]
    ends = boundaries(texts)
    assert ends[0] >= 1 and all(b - a >= interval for a, b in zip(ends, ends[1:-1]))
    assert sum((tokens for tokens, _, _ in texts), []) == whole.token_ids
    assert "".join(text for _, text, _ in texts) == whole.text


def test_the_engines_interval_is_the_least_a_request_gets(llm_every_3):
    prompt = random_prompts([25], seed=3)[0]
    every_3 = list(range(1, MAX_TOKENS, 3)) + [MAX_TOKENS]
    ids = dict(detokenize=False)
    assert boundaries(stream(llm_every_3, prompt, **ids)[0]) == every_3  # no interval of its own: the engine's
    assert boundaries(stream(llm_every_3, prompt, stream_interval=2, **ids)[0]) == every_3  # a shorter one: raised
    assert boundaries(stream(llm_every_3, prompt, stream_interval=7, **ids)[0]) == [1, 8, 15, MAX_TOKENS]


def test_cumulative_outputs_and_samples_are_spaced_alike(llm):
    prompt = random_prompts([30], seed=5)[0]
    cumulative = stream(llm, prompt, RequestOutputKind.CUMULATIVE, stream_interval=6)[0]  # text or not
    assert [len(tokens) for tokens, _, _ in cumulative] == [1, 7, 13, 19, MAX_TOKENS]
    assert cumulative[-1][1] == expected(llm, prompt)[0].text
    samples = stream(llm, prompt, n=2, stream_interval=8, detokenize=False)
    for index, whole in enumerate(expected(llm, prompt, n=2)):
        assert boundaries(samples[index]) == [1, 9, 17, MAX_TOKENS]
        assert sum((tokens for tokens, _, _ in samples[index]), []) == whole.token_ids


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "4"])
def test_a_bad_interval_is_refused_naming_it(llama_dir, value):
    with pytest.raises(ValueError, match="stream_interval"):
        SamplingParams(stream_interval=value)
    with pytest.raises(ValueError, match="stream_interval"):
        LLM(llama_dir, stream_interval=value)
