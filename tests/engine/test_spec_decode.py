"""Speculative decoding with the n-gram proposer: greedy outputs identical to plain decoding (stops and
max_tokens inside accepted runs, preemption, abort, prefix caching), verification under sampling preserves the
target distribution (chi-square) and gives a seeded request the tokens of plain decoding, and no KV block
leaks."""

import pytest
import torch

from conftest import assert_all_blocks_free, random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.engine.request import Request
from pagedllm.engine.sampler import Sampler
from pagedllm.engine.spec_decode.ngram import NgramProposer
from pagedllm.engine.spec_decode.verifier import verify
from pagedllm.tiny_model import first_layers_model

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def repetitive_prompts():
    """Prompts that repeat themselves, so prompt lookup finds continuations."""
    base = random_prompts([12, 9, 15, 7], seed=11)
    return [p + p[1:] + p[1:4] for p in base] + random_prompts([5, 30], seed=12)


def run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def test_ngram_proposer_continues_the_latest_match():
    prop = NgramProposer(3, 1, 3)
    assert prop.lookup([5, 6, 7, 8, 9, 5, 6, 7], limit=10) == [8, 9, 5]
    assert prop.lookup([1, 2, 3, 1, 2, 9, 1, 2], limit=10) == [9, 1, 2]  # latest occurrence of [1, 2]
    assert prop.lookup([1, 2, 3, 4], limit=10) == []
    assert prop.lookup([5, 6, 7, 5, 6], limit=1) == [7]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_speculation_is_token_identical(model_dir, arch):
    d = model_dir(arch)
    prompts = repetitive_prompts()
    kw = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=16 << 20)
    plain, spec = LLM(d, **kw), LLM(d, speculative_config=SPEC, **kw)
    # Long runs: the random tiny model falls into loops, which prompt lookup then predicts.
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (180, 17, 150, 5, 26, 160)]
    assert run(spec, prompts, params) == run(plain, prompts, params)
    s = spec.get_stats()
    assert s.spec_decode_num_accepted_tokens > 20  # speculation really happened and paid
    assert s.spec_decode_num_drafts < s.generation_tokens  # fewer verification runs than tokens
    assert sum(s.spec_decode_accepted_per_position) == s.spec_decode_num_accepted_tokens
    assert_all_blocks_free(spec)


def test_stops_inside_accepted_runs(model_dir):
    d = model_dir("llama")
    prompts = repetitive_prompts()[:4]
    kw = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=16 << 20)
    plain, spec = LLM(d, **kw), LLM(d, speculative_config=SPEC, **kw)
    free_run = run(plain, prompts, SamplingParams(temperature=0, max_tokens=180, ignore_eos=True))
    for (tokens, text, _), prompt in zip(free_run, prompts):
        # Late in the run, where the loops make most drafts accepted.
        cases = [SamplingParams(temperature=0, max_tokens=180, ignore_eos=True, stop_token_ids=[tokens[-10]]),
                 SamplingParams(temperature=0, max_tokens=180, ignore_eos=True, stop=[text[-25:-22]]),
                 SamplingParams(temperature=0, max_tokens=163, ignore_eos=True)]
        for params in cases:
            assert run(spec, [prompt], params) == run(plain, [prompt], params), params
    assert spec.get_stats().spec_decode_num_accepted_tokens > 0
    assert_all_blocks_free(spec)


def test_preemption_abort_and_prefix_caching_leak_nothing(model_dir):
    d = model_dir("llama")
    prompts = repetitive_prompts()
    params = SamplingParams(temperature=0, max_tokens=150, ignore_eos=True)
    kw = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=40 * 16384, max_num_batched_tokens=256)
    reference = run(LLM(d, **{**kw, "kv_cache_memory_bytes": 8 << 20}), prompts, params)
    spec = LLM(d, speculative_config=SPEC, **kw)
    assert run(spec, prompts, params) == reference
    assert spec.get_stats().num_preemptions > 0 and spec.get_stats().spec_decode_num_accepted_tokens > 0
    assert_all_blocks_free(spec)
    engine = spec.engine
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    for _ in range(6):
        engine.step()
    engine.abort_request(ids[0])
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(spec)


def _request(params):
    return Request("r", [0, 1], params, {1}, 16, max_tokens=10)


def _chi_square(counts, probs, n):
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)


def test_ngram_verification_under_sampling_preserves_the_target_distribution():
    """Emitted first tokens, over many draws with a fixed (point-mass) draft, must follow the target's
    distribution (chi-square, 5 degrees of freedom, critical value 20.5 at p = 0.001); always accepting fails
    it."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, 1.5], [0.3, 0.2, 0.1, 0.0, 0.4, 0.5]])
    params = SamplingParams(temperature=1.0)
    target = torch.softmax(logits[0], -1).tolist()
    draft = 5
    n = 20000
    gen = torch.Generator().manual_seed(0)
    counts, accepted = [0] * 6, 0
    for _ in range(n):
        emitted = verify(logits, [draft], _request(params), gen)
        counts[emitted[0]] += 1
        accepted += len(emitted) == 2
    assert _chi_square(counts, target, n) < 20.5
    # accepted with probability p(draft), as rejection sampling accepts a point-mass draft (within 5 sigma)
    assert abs(accepted - n * target[draft]) < 5 * (n * target[draft] * (1 - target[draft])) ** 0.5
    always_accept = [n if t == draft else 0 for t in range(6)]
    assert _chi_square(always_accept, target, n) > 20.5


@pytest.mark.parametrize("controls", [{}, {"top_k": 3}, {"top_p": 0.7}, {"min_p": 0.3}])
def test_seeded_ngram_verification_emits_what_the_sampler_draws(controls):
    """For a seeded request, verification emits position by position the tokens the plain sampler draws from the
    same logits: all drafts right, all are accepted; a wrong one (under top-k, a token of probability 0) ends the
    run with the sampler's token in its place."""
    torch.manual_seed(0)
    logits = torch.randn(5, 40)
    params = SamplingParams(temperature=0.9, seed=123, **controls)
    sampler, req = Sampler(seed=0), _request(params)
    drawn = [sampler(logits[i:i + 1], [req])[0].token_id for i in range(5)]
    assert verify(logits, drawn[:4], _request(params), torch.Generator()) == drawn
    wrong = int(logits[2].argmin()) if drawn[2] != int(logits[2].argmin()) else int(logits[2].argmax())
    assert verify(logits, drawn[:2] + [wrong, drawn[3]], _request(params), torch.Generator()) == drawn[:3]


def test_seeded_sampling_with_speculation_gives_the_tokens_of_plain_decoding(model_dir):
    """Verification draws a seeded request's token at each position as the plain sampler would, so its tokens do
    not depend on how many drafts each step held (a tight token budget trims them) or on speculation at all."""
    d = model_dir("llama")
    kw = dict(dtype="float32", max_model_len=256, seed=3)
    plain = LLM(d, **kw)
    spec = LLM(d, speculative_config=SPEC, **kw)
    trimmed = LLM(d, speculative_config=SPEC, max_num_batched_tokens=8, **kw)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=5, max_tokens=150, ignore_eos=True)
    prompts = repetitive_prompts()[:3]
    expected = run(plain, prompts, params)
    assert run(spec, prompts, params) == expected
    assert run(trimmed, prompts, params) == expected
    assert spec.get_stats().spec_decode_num_accepted_tokens > 0
    assert trimmed.get_stats().spec_decode_num_accepted_tokens > 0
    assert_all_blocks_free(spec)
    assert_all_blocks_free(trimmed)


def test_speculative_config_is_validated(llama_dir):
    with pytest.raises(ValueError, match="speculative_config"):
        LLM(llama_dir, speculative_config={"method": "eagle"})


def first_layers_draft(model_dir_path, out_dir, layers=1):
    return first_layers_model(model_dir_path, out_dir, layers)


def test_draft_model_greedy_identical_and_self_draft_accepts_everything(model_dir, tmp_path):
    d = model_dir("llama")
    prompts = repetitive_prompts()
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (60, 17, 45, 5, 26, 50)]
    kw = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=16 << 20)
    reference = run(LLM(d, **kw), prompts, params)
    draft = first_layers_draft(d, str(tmp_path / "draft"))
    with_draft = LLM(d, speculative_config={"method": "draft_model", "model": draft,
                                            "num_speculative_tokens": 3}, **kw)
    assert run(with_draft, prompts, params) == reference
    s = with_draft.get_stats()
    assert s.spec_decode_num_draft_tokens > 0
    assert_all_blocks_free(with_draft)
    assert not with_draft.engine.proposer.sequences and with_draft.engine.proposer.kv.all_free()
    itself = LLM(d, speculative_config={"method": "draft_model", "model": d, "num_speculative_tokens": 3}, **kw)
    assert run(itself, prompts, params) == reference
    s = itself.get_stats()
    assert s.spec_decode_num_accepted_tokens == s.spec_decode_num_draft_tokens > 0  # a perfect draft
    assert s.spec_decode_num_drafts < s.generation_tokens / 2


def test_draft_model_sampling_and_preemption(model_dir, tmp_path):
    d = model_dir("llama")
    draft = first_layers_draft(d, str(tmp_path / "draft"))
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    kw = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=30 * 16384, max_num_batched_tokens=256)
    prompts = repetitive_prompts()
    llm = LLM(d, speculative_config=spec, **kw)
    greedy = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    assert run(llm, prompts, greedy) == run(LLM(d, **{**kw, "kv_cache_memory_bytes": 8 << 20}), prompts, greedy)
    assert llm.get_stats().num_preemptions > 0
    sampled = SamplingParams(temperature=0.9, seed=4, max_tokens=60, ignore_eos=True)
    assert run(llm, prompts, sampled) == run(llm, prompts, sampled)  # seeded: reproducible
    assert_all_blocks_free(llm)
    assert llm.engine.proposer.kv.all_free()


def test_rejection_sampling_with_a_draft_distribution():
    """With a non-degenerate draft q, accepted-or-resampled first tokens still follow the target p."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, 1.5], [0.3, 0.2, 0.1, 0.0, 0.4, 0.5]])
    params = SamplingParams(temperature=1.0)
    p = torch.softmax(logits[0], -1)
    q = torch.softmax(torch.tensor([0.0, 2.0, 0.0, 1.0, 0.0, 0.0]), -1)
    gen = torch.Generator().manual_seed(1)
    n, counts = 20000, [0] * 6
    for _ in range(n):
        draft = int(torch.multinomial(q, 1, generator=gen))
        counts[verify(logits, [draft], _request(params), gen, q[None])[0]] += 1
    assert _chi_square(counts, p.tolist(), n) < 20.5
    naive = [n * float(x) for x in q]  # accepting every draft would reproduce q instead
    assert _chi_square(naive, p.tolist(), n) > 20.5


def test_per_request_draft_counts_add_up_to_the_engine_totals(llama_dir):
    """What return_perf_metrics reports per request (acceptance_rate, total_draft_tokens, ...)."""
    spec = LLM(llama_dir, dtype="float32", max_model_len=512, kv_cache_memory_bytes=16 << 20,
               speculative_config=SPEC)
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    outs = spec.generate([{"prompt_token_ids": p} for p in repetitive_prompts()], params, use_tqdm=False)
    s = spec.get_stats()
    assert sum(o.metrics.num_draft_tokens for o in outs) == s.spec_decode_num_draft_tokens
    assert sum(o.metrics.num_accepted_draft_tokens for o in outs) == s.spec_decode_num_accepted_tokens > 0
    assert all(o.metrics.num_accepted_draft_tokens <= o.metrics.num_draft_tokens for o in outs)
