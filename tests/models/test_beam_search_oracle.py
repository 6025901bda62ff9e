"""Beam search equals transformers' generate(num_beams=W) token for token (fp32), beams share blocks."""

import json
import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import assert_all_blocks_free, random_prompts
from pagedllm import LLM, BeamSearchParams, SamplingParams

CASES = [(1.0, False), (0.5, True), (2.0, "never"), (-1.0, False)]  # (length_penalty, early_stopping)


def hf_beams(hf, prompt, width, max_tokens, length_penalty, early_stopping):
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            max_new_tokens=max_tokens,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            return_dict_in_generate=True,
            output_scores=True,
        )
    return [s[len(prompt) :].tolist() for s in out.sequences], out.sequences_scores.tolist()


def our_beams(llm, prompt, max_tokens, length_penalty, early_stopping):
    params = BeamSearchParams(beam_width=4, max_tokens=max_tokens, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    return llm.beam_search([{"prompt_token_ids": prompt}], params)[0]


def strip_padding(seqs, ours):
    """transformers right-pads shorter beams (after their EOS): cut each to our beam's length."""
    return [
        s[: len(o)] if len(s) > len(o) and all(t == s[len(o)] for t in s[len(o) :]) else s
        for s, o in zip(seqs, ours)
    ]


@pytest.fixture(scope="module")
def llama(llama_dir):
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    return hf, LLM(llama_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 24)


@pytest.mark.parametrize("length_penalty,early_stopping", CASES)
def test_width_4_equals_transformers(llama, length_penalty, early_stopping):
    hf, llm = llama
    for prompt in random_prompts([21, 5, 40], seed=1):
        expected, scores = hf_beams(hf, prompt, 4, 16, length_penalty, early_stopping)
        out = our_beams(llm, prompt, 16, length_penalty, early_stopping)
        got = [c.token_ids for c in out.outputs]
        assert strip_padding(expected, got) == got
        lengths = [len(t) for t in got]
        ours = [c.cumulative_logprob / n**length_penalty for c, n in zip(out.outputs, lengths)]
        assert ours == pytest.approx(scores, rel=1e-5, abs=1e-4)  # fp32 sums of ~16 terms near -400
    assert_all_blocks_free(llm)


def test_width_1_equals_greedy(llama):
    _, llm = llama
    prompts = [{"prompt_token_ids": p} for p in random_prompts([9, 33, 50], seed=4)]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    beams = llm.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=12))
    assert [b.outputs[0].token_ids for b in beams] == [g.outputs[0].token_ids for g in greedy]
    assert all(len(b.outputs) == 1 for b in beams)


def test_beams_that_end_in_eos_match_transformers(llama_dir, llama, tmp_path):
    """Declare a token the beams often pick as a second EOS, so hypotheses finish early and the rules for
    finished beams (rank < W, length with the EOS, the stopping bound) decide the result."""
    hf, llm = llama
    prompts = random_prompts([13, 27], seed=6)
    first = llm.beam_search(
        [{"prompt_token_ids": p} for p in prompts], BeamSearchParams(beam_width=4, max_tokens=6)
    )
    eos = first[0].outputs[1].token_ids[2]
    shutil.copytree(llama_dir, tmp_path, dirs_exist_ok=True)
    gen_path = os.path.join(tmp_path, "generation_config.json")
    with open(gen_path) as f:
        gen = json.load(f)
    gen["eos_token_id"] = [1, eos]
    with open(gen_path, "w") as f:
        json.dump(gen, f)
    hf_eos = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours_eos = LLM(str(tmp_path), dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 24)
    ended = 0
    for length_penalty, early_stopping in CASES:
        for prompt in prompts:
            expected, _ = hf_beams(hf_eos, prompt, 4, 12, length_penalty, early_stopping)
            out = our_beams(ours_eos, prompt, 12, length_penalty, early_stopping)
            got = [c.token_ids for c in out.outputs]
            assert strip_padding(expected, got) == got
            ended += sum(c.finish_reason == "stop" and c.token_ids[-1] == eos for c in out.outputs)
    assert ended > 0  # EOS really ended beams
    assert_all_blocks_free(ours_eos)


def test_beams_share_blocks_and_free_them(llama):
    _, llm = llama
    engine, pool = llm.engine, llm.engine.kv.pool
    engine.add_request(
        {"prompt_token_ids": random_prompts([40], seed=2)[0]},
        SamplingParams(beam_width=4, temperature=0, max_tokens=30, ignore_eos=True),
        request_id="b",
    )
    shared = 0
    while engine.has_unfinished_requests():
        engine.step()
        tables = [engine.kv.block_ids(r) for r in engine.scheduler.requests]
        if len(tables) == 4:
            shared = max(shared, pool.blocks[tables[0][0]].ref_cnt)
    assert shared == 4  # the prompt's first block, held once by all four beams
    assert_all_blocks_free(llm)


def test_beam_search_with_preemption_gives_the_same_beams(llama_dir, llama):
    _, roomy = llama
    prompts = [{"prompt_token_ids": p} for p in random_prompts([30, 52, 41], seed=9)]
    params = BeamSearchParams(beam_width=3, max_tokens=24, ignore_eos=True)
    expected = [[c.token_ids for c in o.outputs] for o in roomy.beam_search(prompts, params)]
    tight = LLM(
        llama_dir,
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes=18 * 16384,
        max_num_batched_tokens=96,
    )
    got = [[c.token_ids for c in o.outputs] for o in tight.beam_search(prompts, params)]
    assert tight.get_stats().num_preemptions > 0
    assert got == expected
    assert_all_blocks_free(tight)


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"temperature": 0.7}, "temperature"),
        ({"top_k": 5}, "top_p"),
        ({"n": 3}, "n"),
        ({"stop": ["x"]}, "stop"),
        ({"logprobs": 2}, "logprobs"),
        ({"presence_penalty": 0.5}, "logits_processors"),
        ({"min_tokens": 2}, "min_tokens"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
        ({"length_penalty": float("nan")}, "length_penalty"),
    ],
)
def test_what_beam_search_does_not_combine_with_is_refused(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(beam_width=2, **({"temperature": 0} | kw))


def test_beams_that_time_out_together_end_the_request_once(llama):
    _, llm = llama
    engine = llm.engine
    engine.add_request({"prompt_token_ids": random_prompts([20], seed=3)[0]},
                       SamplingParams(beam_width=4, temperature=0, max_tokens=200, ignore_eos=True),
                       request_id="slow", timeout=0.05)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs) == 1 and outs[0].finished and outs[0].request_id == "slow"
    assert {c.finish_reason for c in outs[0].outputs} == {"timeout"}
    assert_all_blocks_free(llm)
