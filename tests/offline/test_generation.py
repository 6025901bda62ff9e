"""Sampling, stop conditions, aborts and bad input through the offline API."""

import json
import os
import shutil

import pytest

from conftest import assert_all_blocks_free, random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.models.registry import UnsupportedArchitectureError

TEXT_PROMPTS = ["def main():\n    ", "import os\nimport sys\n", "class Foo(object):", "# Copyright",
                "return self._", "for i in range(10):", "naïve café 東京", "x"]


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, dtype="float32", max_model_len=512, kv_cache_memory_bytes=16 << 20)


def gen1(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(**kw), use_tqdm=False)[0].outputs[0]


def test_text_prompts_and_detokenized_text_match_a_full_decode(llm):
    tok = llm.get_tokenizer()
    outs = llm.generate(TEXT_PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)
    for prompt, out in zip(TEXT_PROMPTS, outs):
        assert out.prompt == prompt and out.prompt_token_ids == tok.encode(prompt)
        c = out.outputs[0]
        assert len(c.token_ids) == 24 and c.finish_reason == "length"
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    assert_all_blocks_free(llm)


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=200, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate(TEXT_PROMPTS[0], params, use_tqdm=False)[0].outputs[0].token_ids
    others = random_prompts([3 + 7 * i for i in range(16)], seed=9)
    batch = [{"prompt_token_ids": p} for p in others[:8]] + [TEXT_PROMPTS[0]] + \
            [{"prompt_token_ids": p} for p in others[8:]]
    other_params = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    outs = llm.generate(batch, [other_params] * 8 + [params] + [other_params] * 8, use_tqdm=False)
    assert outs[8].outputs[0].token_ids == alone
    # A different seed gives a different sequence (the seed is really used).
    params2 = SamplingParams(temperature=0.9, top_p=0.95, top_k=200, seed=99, max_tokens=24, ignore_eos=True)
    assert llm.generate(TEXT_PROMPTS[0], params2, use_tqdm=False)[0].outputs[0].token_ids != alone
    assert_all_blocks_free(llm)


def test_stop_string_is_excluded_from_text(llm):
    full = gen1(llm, TEXT_PROMPTS[1], temperature=0, max_tokens=40, ignore_eos=True)
    stop = full.text[10:13]
    assert len(stop) == 3
    idx = full.text.find(stop)
    c = gen1(llm, TEXT_PROMPTS[1], temperature=0, max_tokens=40, ignore_eos=True, stop=[stop, "\x00never"])
    assert c.text == full.text[:idx]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.token_ids == full.token_ids[:len(c.token_ids)]


def test_stop_token_ids_min_tokens_and_max_tokens(llm):
    full = gen1(llm, TEXT_PROMPTS[2], temperature=0, max_tokens=30, ignore_eos=True)
    stop_tok = full.token_ids[3]
    first = full.token_ids.index(stop_tok)
    c = gen1(llm, TEXT_PROMPTS[2], temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_tok])
    assert c.token_ids == full.token_ids[:first + 1]
    assert c.finish_reason == "stop" and c.stop_reason == stop_tok
    tok = llm.get_tokenizer()
    assert c.text == tok.decode(full.token_ids[:first])  # the stop token's text is not included
    # min_tokens masks the stop token until enough tokens exist
    m = gen1(llm, TEXT_PROMPTS[2], temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_tok],
             min_tokens=first + 3)
    assert len(m.token_ids) >= first + 3
    assert stop_tok not in m.token_ids[:first + 2]
    # max_tokens
    short = gen1(llm, TEXT_PROMPTS[2], temperature=0, max_tokens=7)
    assert short.token_ids == full.token_ids[:7] and short.finish_reason == "length"


@pytest.fixture(scope="module")
def eos_model(llama_dir, tmp_path_factory):
    """A copy of the tiny model whose EOS is a token greedy decoding emits early."""
    llm = LLM(llama_dir, dtype="float32", max_model_len=256)
    toks = llm.generate(TEXT_PROMPTS[0], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    d = str(tmp_path_factory.mktemp("eos_model"))
    shutil.copytree(llama_dir, d, dirs_exist_ok=True)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": toks[4], "pad_token_id": 2}, f)
    return d, toks


def test_eos_and_ignore_eos(eos_model):
    d, toks = eos_model
    llm = LLM(d, dtype="float32", max_model_len=256)
    eos = toks[4]
    first = toks.index(eos)
    c = gen1(llm, TEXT_PROMPTS[0], temperature=0, max_tokens=20)
    assert c.token_ids == toks[:first + 1] and c.finish_reason == "stop" and c.stop_reason is None
    c = gen1(llm, TEXT_PROMPTS[0], temperature=0, max_tokens=20, ignore_eos=True)
    assert len(c.token_ids) == 20 and c.finish_reason == "length" and c.token_ids[:8] == toks
    c = gen1(llm, TEXT_PROMPTS[0], temperature=0, max_tokens=20, min_tokens=first + 2)
    assert len(c.token_ids) >= first + 2 and eos not in c.token_ids[:first + 1]
    assert_all_blocks_free(llm)


def test_max_tokens_default_runs_to_the_context_limit(llama_dir):
    llm = LLM(llama_dir, dtype="float32", max_model_len=64)
    c = gen1(llm, {"prompt_token_ids": [0, 5, 6, 7]}, temperature=0, ignore_eos=True)
    assert len(c.token_ids) == 60 and c.finish_reason == "length"


def test_logprobs(llm):
    c = gen1(llm, TEXT_PROMPTS[3], temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    assert len(c.logprobs) == 6
    total = 0.0
    for tok, entry in zip(c.token_ids, c.logprobs):
        assert len(entry) == 3 and tok in entry
        assert entry[tok].rank == 1  # greedy picks the most likely token
        assert max(e.logprob for e in entry.values()) == entry[tok].logprob
        total += entry[tok].logprob
    assert c.cumulative_logprob == pytest.approx(total)
    plain = gen1(llm, TEXT_PROMPTS[3], temperature=0, max_tokens=6, ignore_eos=True)
    assert plain.token_ids == c.token_ids and plain.logprobs is None and plain.cumulative_logprob is None


def test_abort_frees_blocks_and_others_finish(llm):
    engine = llm.engine
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
           for p in TEXT_PROMPTS[:4]]
    for _ in range(3):
        engine.step()
    out = engine.abort_request(ids[1])
    assert out.finished and out.outputs[0].finish_reason == "abort"
    assert engine.kv.block_ids(ids[1]) == []
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    assert sorted(done) == sorted([ids[0], ids[2], ids[3]])
    assert all(len(o.outputs[0].token_ids) == 30 for o in done.values())
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -5}, "top_k"), ({"min_p": 2}, "min_p"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2.5}, "max_tokens"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"), ({"logprobs": -1}, "logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"seed": "x"}, "seed"), ({"n": 0}, "n"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": float("inf")}, "temperature"),
    ({"seed": 2 ** 64}, "seed"), ({"seed": -1}, "seed"), ({"max_tokens": 2 ** 31}, "max_tokens"),
    ({"max_tokens": 10 ** 400}, "max_tokens"), ({"stop": 5}, "stop"), ({"stop_token_ids": ["7"]}, "stop_token_ids"),
    ({"top_k": 2 ** 40}, "top_k"), ({"repetition_penalty": float("inf")}, "repetition_penalty"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs)


def test_bad_prompts_are_rejected_and_do_not_disturb_running_requests(llm):
    engine = llm.engine
    good = engine.add_request(TEXT_PROMPTS[0], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    engine.step()
    bad = [("x" * 5000, "prompt:"), ({"prompt_token_ids": []}, "prompt:"),
           ({"prompt_token_ids": [0, 999999]}, "prompt_token_ids:"), ({"foo": 1}, "prompt:"), (3.5, "prompt:")]
    for prompt, msg in bad:
        with pytest.raises(ValueError, match=msg):
            engine.add_request(prompt, SamplingParams())
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("hi", SamplingParams(), request_id=good)
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[-1].request_id == good and len(outs[-1].outputs[0].token_ids) == 10
    assert_all_blocks_free(llm)
    with pytest.raises(ValueError, match="prompt"):  # generate() validates all prompts before queuing any
        llm.generate(["fine", "x" * 5000], use_tqdm=False)
    assert_all_blocks_free(llm)


def test_unknown_architecture_lists_the_supported_ones(llama_dir, tmp_path):
    shutil.copytree(llama_dir, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="FooForCausalLM.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        LLM(str(tmp_path))


def test_register_model_makes_a_new_architecture_loadable(llama_dir, tmp_path):
    from pagedllm.models import register_model
    from pagedllm.models.llama import LlamaForCausalLM

    class MyLlama(LlamaForCausalLM):
        pass

    register_model("MyLlamaForCausalLM", MyLlama)
    shutil.copytree(llama_dir, tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["MyLlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=128)
    assert isinstance(llm.engine.executor.model, MyLlama)
    assert len(gen1(llm, "hi", temperature=0, max_tokens=3).token_ids) == 3


def test_engine_arguments_are_validated():
    with pytest.raises(ValueError, match="unknown engine argument 'blok_size'"):
        LLM("/nonexistent", blok_size=16)
    with pytest.raises(ValueError, match="block_size"):
        LLM("/nonexistent", block_size=3)
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM("/nonexistent", scheduling_policy="lifo")


def test_too_small_kv_budget_is_a_clear_error(llama_dir):
    with pytest.raises(ValueError, match="kv_cache_memory_bytes"):
        LLM(llama_dir, max_model_len=1024, kv_cache_memory_bytes=100_000)


def test_penalties_change_greedy_output_and_stay_deterministic(llm):
    base = gen1(llm, TEXT_PROMPTS[4], temperature=0, max_tokens=30, ignore_eos=True).token_ids
    pen = gen1(llm, TEXT_PROMPTS[4], temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.8,
               frequency_penalty=1.0, presence_penalty=1.0).token_ids
    again = gen1(llm, TEXT_PROMPTS[4], temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=1.8,
                 frequency_penalty=1.0, presence_penalty=1.0).token_ids
    assert pen == again
    assert len(set(pen)) >= len(set(base))  # penalties push away from repeats


def test_offline_stats_and_periodic_log_line(llama_dir, caplog):
    import logging

    llm = LLM(llama_dir, dtype="float32", max_model_len=128, log_stats=True, log_stats_interval_s=0.0)
    with caplog.at_level(logging.INFO, logger="pagedllm.stats"):
        llm.generate(["a", "b"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert any("Avg generation throughput" in r.message and "KV cache usage" in r.message for r in caplog.records)
    s = llm.get_stats()
    assert s.generation_tokens == 10 and s.requests_finished == {"length": 2}
    quiet = LLM(llama_dir, dtype="float32", max_model_len=128)  # log_stats defaults to off offline
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagedllm.stats"):
        quiet.generate("a", SamplingParams(max_tokens=3), use_tqdm=False)
    assert not [r for r in caplog.records if r.name == "pagedllm.stats"]
