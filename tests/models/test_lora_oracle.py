"""Multi-LoRA against transformers: greedy tokens with an adapter equal transformers' on the model with that
adapter merged by PEFT (`merge_and_unload`), in fp32; a batch mixing adapters and the base model gives each
request its own model's tokens, with and without preemption; eviction and reload under a small max_loras change
nothing; the prefix cache never shares KV between adapters; malformed adapters are refused with a message."""

import json
import os

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from conftest import assert_all_blocks_free, random_prompts
from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.tiny_model import LORA_TARGETS, make_lora_adapter
from test_oracle import hf_greedy

LENGTHS = [3, 17, 40, 100]
MAX_TOKENS = [12, 9, 16, 7]


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    """adapters(arch, rank, seed, **config) -> a LoRARequest for a random PEFT adapter (made once)."""
    made = {}

    def get(arch, rank=8, seed=1, lora_id=None, **config):
        key = (arch, rank, seed, tuple(sorted((k, repr(v)) for k, v in config.items())))
        if key not in made:
            path = str(tmp_path_factory.mktemp(f"lora_{arch}_r{rank}"))
            make_lora_adapter(model_dir(arch), path, rank=rank, seed=seed, **config)
            made[key] = LoRARequest(f"{arch}-r{rank}-s{seed}-{len(made)}", lora_id or len(made) + 1, path)
        return made[key]

    return get


def merged_greedy(base_dir, lora, prompts, max_tokens):
    """transformers' greedy tokens on the base model with `lora` merged by PEFT (None: the base model)."""
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if lora is not None:
        model = PeftModel.from_pretrained(model, lora.lora_path).merge_and_unload()
    return hf_greedy(model, prompts, max_tokens)


def ours(llm, prompts, max_tokens, loras):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


def lora_llm(model, max_loras=4, **kwargs):
    args = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=32 << 20, enable_lora=True,
                max_loras=max_loras, max_lora_rank=16)
    return LLM(model, **{**args, **kwargs})


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("rank", [8, 16])
def test_adapter_matches_merged_transformers(model_dir, adapters, arch, rank):
    lora = adapters(arch, rank)
    prompts = random_prompts(LENGTHS, seed=rank)
    expected = merged_greedy(model_dir(arch), lora, prompts, MAX_TOKENS)
    assert expected != merged_greedy(model_dir(arch), None, prompts, MAX_TOKENS)  # the adapter matters
    llm = lora_llm(model_dir(arch))
    assert ours(llm, prompts, MAX_TOKENS, lora) == expected
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("preempt", [False, True], ids=["roomy", "preempting"])
def test_mixed_batch_gives_each_request_its_own_model(model_dir, adapters, preempt):
    d = model_dir("llama")
    models = [adapters("llama", 8, seed=1), adapters("llama", 16, seed=2), adapters("llama", 8, seed=3), None]
    prompts = random_prompts([5, 30, 70, 120, 9, 50, 90, 33, 140, 12, 64, 100], seed=11)
    max_tokens = [10 + i % 7 for i in range(len(prompts))]
    loras = [models[i % 4] for i in range(len(prompts))]
    expected = {}
    for m in models:
        mine = [i for i, lo in enumerate(loras) if lo is m]
        for i, toks in zip(mine, merged_greedy(d, m, [prompts[i] for i in mine], [max_tokens[i] for i in mine])):
            expected[i] = toks
    kwargs = dict(kv_cache_memory_bytes=24 * 16384, max_model_len=256, max_num_batched_tokens=128) if preempt else {}
    llm = lora_llm(d, max_loras=3, **kwargs)
    assert ours(llm, prompts, max_tokens, loras) == [expected[i] for i in range(len(prompts))]
    assert (llm.get_stats().num_preemptions > 0) == preempt
    assert_all_blocks_free(llm)


def test_embedding_and_lm_head_adapter(model_dir, adapters):
    """An adapter that also carries LoRA on embed_tokens and lm_head (llama: untied)."""
    d = model_dir("llama")
    lora = adapters("llama", 8, seed=5, targets=LORA_TARGETS + ("embed_tokens", "lm_head"))
    prompts = random_prompts(LENGTHS, seed=5)
    expected = merged_greedy(d, lora, prompts, MAX_TOKENS)
    without_extra = adapters("llama", 8, seed=5)
    assert expected != merged_greedy(d, without_extra, prompts, MAX_TOKENS)  # the two modules matter
    assert ours(lora_llm(d), prompts, MAX_TOKENS, lora) == expected


def test_adapter_with_its_own_embedding_and_lm_head(model_dir, adapters, tmp_path):
    """modules_to_save: the adapter's full embed_tokens and lm_head replace the model's for its requests (here
    perturbed after saving, so that they differ from the base model's)."""
    d = model_dir("llama")
    saved = adapters("llama", 8, seed=8, modules_to_save=["embed_tokens", "lm_head"])

    def perturb(tensors, config):
        g = torch.Generator().manual_seed(0)
        for key in [k for k in tensors if k.endswith(("lm_head.weight", "embed_tokens.weight"))]:
            tensors[key] = tensors[key] + torch.randn(tensors[key].shape, generator=g) * 0.5

    lora = LoRARequest("own-head", 77, _corrupt(saved.lora_path, str(tmp_path / "own"), perturb))
    prompts = random_prompts(LENGTHS, seed=8)
    expected = merged_greedy(d, lora, prompts, MAX_TOKENS)
    assert expected != merged_greedy(d, saved, prompts, MAX_TOKENS)
    llm = lora_llm(d)
    assert ours(llm, prompts, MAX_TOKENS, [lora, None, lora, saved]) == [
        expected[0], merged_greedy(d, None, prompts[1:2], MAX_TOKENS[1:2])[0], expected[2],
        merged_greedy(d, saved, prompts[3:], MAX_TOKENS[3:])[0]]


def test_gemma3_adapter_with_a_scaled_embedding(tmp_path):
    """Gemma 3 scales its embeddings by sqrt(hidden): PEFT scales the embedding's LoRA delta with them."""
    from pagedllm.tiny_model import make_variant_model

    d = make_variant_model(str(tmp_path / "gemma3"), arch="gemma3")
    lora = LoRARequest("g", 1, make_lora_adapter(d, str(tmp_path / "adapter"), rank=8, seed=4,
                                                 targets=LORA_TARGETS + ("embed_tokens", "lm_head")))
    prompts = random_prompts(LENGTHS, seed=9)
    assert ours(lora_llm(d), prompts, MAX_TOKENS, lora) == merged_greedy(d, lora, prompts, MAX_TOKENS)


def test_rslora_and_per_module_alpha(model_dir, adapters):
    d = model_dir("qwen2")
    rs = adapters("qwen2", 16, seed=6, use_rslora=True)
    patterned = adapters("qwen2", 8, seed=7, alpha_pattern={"q_proj": 64, "down_proj": 2},
                         rank_pattern={"o_proj": 4})
    prompts = random_prompts(LENGTHS, seed=6)
    llm = lora_llm(d)
    for lora in (rs, patterned):
        assert ours(llm, prompts, MAX_TOKENS, lora) == merged_greedy(d, lora, prompts, MAX_TOKENS)


def test_eviction_and_reload_do_not_change_outputs(model_dir, adapters):
    """Four adapters in use, one or two slots (and host copies for two): adapters are evicted from their slots
    and put back, and every request still gets its adapter's tokens."""
    d = model_dir("llama")
    models = [adapters("llama", 8, seed=s) for s in (1, 2, 3, 4)]
    prompts = random_prompts([20, 40, 8, 60, 33, 15, 70, 25], seed=12)
    max_tokens = [8] * len(prompts)
    loras = [models[i % 4] for i in range(len(prompts))]
    reference = ours(lora_llm(d, max_loras=4), prompts, max_tokens, loras)
    for max_loras, max_cpu in ((1, None), (2, 2)):
        llm = lora_llm(d, max_loras=max_loras, max_cpu_loras=max_cpu)
        steps = []
        place = llm.engine.lora_slots.place
        llm.engine.lora_slots.place = lambda rs: steps.append({r.lora.lora_int_id for r in rs if r.lora}) or place(rs)
        for _ in range(2):  # the second pass finds the first adapters evicted: they are loaded again
            assert ours(llm, prompts, max_tokens, loras) == reference
        assert max(len(s) for s in steps) <= max_loras  # never more adapters in a step than slots
        assert llm.get_stats().lora_loads > 4
        assert_all_blocks_free(llm)


def test_adapters_with_speculation_samples_and_beams(model_dir, adapters):
    """An adapter's request speculates (n-gram drafts verified by the adapted model), samples n times and runs
    beam search like any other: greedy speculation keeps the merged model's tokens, each of n seeded samples
    equals its single request, and beam width 1 equals greedy."""
    d = model_dir("llama")
    lora = adapters("llama", 16, seed=2)
    prompts = [p[:1] + p[1:7] * 6 for p in random_prompts([7] * 4, seed=14)]  # repeats for n-gram drafts
    expected = merged_greedy(d, lora, prompts, MAX_TOKENS)
    spec = lora_llm(d, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert ours(spec, prompts, MAX_TOKENS, lora) == expected
    assert spec.get_stats().spec_decode_num_drafts > 0
    llm = lora_llm(d)
    sampled = dict(temperature=1.0, max_tokens=8, ignore_eos=True)
    group = llm.generate([prompts[1]], SamplingParams(n=3, seed=5, **sampled), use_tqdm=False, lora_request=lora)
    singles = llm.generate([prompts[1]] * 3, [SamplingParams(seed=5 + i, **sampled) for i in range(3)],
                           use_tqdm=False, lora_request=lora)
    assert [c.token_ids for c in group[0].outputs] == [o.outputs[0].token_ids for o in singles]
    from pagedllm import BeamSearchParams

    beams = llm.beam_search([prompts[2]], BeamSearchParams(beam_width=1, max_tokens=MAX_TOKENS[2], ignore_eos=True),
                            lora_request=lora)
    assert beams[0].outputs[0].token_ids == expected[2]
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_request_whose_adapter_has_no_slot(model_dir, adapters, policy):
    """One slot, held by a running low-priority request: a request for another adapter waits in its place (FCFS),
    or, ranking higher under the priority policy, takes the slot (the holder is preempted and resumes later)."""
    d = model_dir("llama")
    a, b = adapters("llama", 8, seed=1), adapters("llama", 8, seed=2)
    llm = lora_llm(d, max_loras=1, scheduling_policy=policy)
    engine, ip = llm.engine, llm.engine.input_processor
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    engine.add_request(ip.process({"prompt_token_ids": [0, 5, 9]}, params, priority=5, lora=a), request_id="holder")
    engine.step()
    engine.add_request(ip.process({"prompt_token_ids": [0, 7, 8]}, params, priority=0, lora=b), request_id="urgent")
    engine.step()
    holder, urgent = engine.scheduler.requests["holder"], engine.scheduler.requests["urgent"]
    running = {r.request_id for r in engine.scheduler.running}
    assert running == ({"holder"} if policy == "fcfs" else {"urgent"})
    assert (holder.num_preemptions, urgent.num_computed_tokens > 0) == ((0, False) if policy == "fcfs" else (1, True))
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs["holder"].outputs[0].token_ids == merged_greedy(d, a, [[0, 5, 9]], [30])[0]
    assert outs["urgent"].outputs[0].token_ids == merged_greedy(d, b, [[0, 7, 8]], [30])[0]
    assert_all_blocks_free(llm)


def test_prefix_cache_never_shares_kv_between_adapters(model_dir, adapters):
    d = model_dir("llama")
    a, b = adapters("llama", 8, seed=1), adapters("llama", 8, seed=2)
    prompt = random_prompts([80], seed=13)[0]
    llm = lora_llm(d)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def cached(lora):
        return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False, lora_request=lora)[0].num_cached_tokens

    assert cached(a) == 0
    assert cached(b) == 0 and cached(None) == 0  # same tokens, other model: nothing shared
    assert cached(a) == cached(b) == cached(None) == 64  # each hits its own blocks


def _corrupt(src: str, dst: str, edit) -> str:
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "adapter_model.safetensors"))
    with open(os.path.join(dst, "adapter_config.json")) as f:
        config = json.load(f)
    edit(tensors, config)
    save_file(tensors, os.path.join(dst, "adapter_model.safetensors"))
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return dst


def _first_key(tensors, part):
    return next(k for k in tensors if part in k)


MALFORMED = {
    "wrong shape": (lambda t, c: t.update({(k := _first_key(t, "q_proj.lora_B")): t[k][:-1]}), "do not fit"),
    "unknown module": (lambda t, c: t.update({"base_model.model.model.layers.0.mlp.fc9.lora_A.weight": t[
        _first_key(t, "lora_A")].clone()}), "unknown target module 'fc9'"),
    "unknown target": (lambda t, c: c.update(target_modules=["q_proj", "wq"]), r"unknown target module\(s\) \['wq'\]"),
    "dora": (lambda t, c: c.update(use_dora=True), "DoRA"),
    "scalar lora_A": (lambda t, c: t.update({_first_key(t, "q_proj.lora_A"): torch.tensor(1.0)}), "must be matrices"),
    "alpha not a number": (lambda t, c: c.update(lora_alpha="16"), "must be numbers"),
    "alpha pattern not a regex": (lambda t, c: c.update(alpha_pattern={"q_proj(": 4}), "not a regular expression"),
    "lora bias": (lambda t, c: c.update(bias="all"), "LoRA biases"),
    "modules_to_save": (lambda t, c: c.update(modules_to_save=["lm_head", "score"]), r"modules_to_save \[.score.\]"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_adapter_is_refused_and_costs_nothing_else(model_dir, adapters, tmp_path, case):
    d = model_dir("llama")
    good = adapters("llama", 8, seed=1)
    edit, message = MALFORMED[case]
    bad = LoRARequest("bad", 99, _corrupt(good.lora_path, str(tmp_path / "bad"), edit))
    llm = lora_llm(d)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match=message):
        llm.generate([{"prompt_token_ids": [0, 5, 6]}], params, use_tqdm=False, lora_request=bad)
    out = llm.generate([{"prompt_token_ids": [0, 5, 6]}], params, use_tqdm=False, lora_request=good)
    assert len(out[0].outputs[0].token_ids) == 4
    assert_all_blocks_free(llm)


def test_rank_above_the_limit_and_missing_files_are_refused(model_dir, adapters, tmp_path):
    d = model_dir("llama")
    llm = lora_llm(d, max_lora_rank=8)
    params = SamplingParams(max_tokens=2)
    big = adapters("llama", 16, seed=2)
    with pytest.raises(ValueError, match="rank 16 is above max_lora_rank=8"):
        llm.generate([[0, 5]], params, use_tqdm=False, lora_request=big)
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.generate([[0, 5]], params, use_tqdm=False, lora_request=LoRARequest("x", 50, str(tmp_path)))
    with pytest.raises(ValueError, match="lora_int_id 3 already names"):  # one id, two adapters
        first = adapters("llama", 8, seed=1)
        llm.generate([[0, 5]], params, use_tqdm=False, lora_request=LoRARequest("a", 3, first.lora_path))
        llm.generate([[0, 5]], params, use_tqdm=False, lora_request=LoRARequest("b", 3, str(tmp_path)))


def test_adapter_files_removed_later_cost_only_new_requests_for_them(model_dir, adapters, tmp_path):
    """A checked request carries its adapter's weights: removing the files afterwards changes nothing for it (no
    step reads them). A new request for the adapter, once the host copy is dropped (max_cpu_loras), is refused
    alone, naming the problem; the engine carries on."""
    import shutil

    d = model_dir("llama")
    src, other = adapters("llama", 8, seed=1), adapters("llama", 8, seed=2)
    lora = LoRARequest("moving", 60, shutil.copytree(src.lora_path, str(tmp_path / "moving")))
    llm = lora_llm(d, max_loras=1, max_cpu_loras=1)
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request(engine.input_processor.process({"prompt_token_ids": [0, 5, 9]}, params, lora=lora), request_id="m")
    shutil.rmtree(lora.lora_path)  # before its first step
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert outs[0].outputs[0].token_ids == merged_greedy(d, src, [[0, 5, 9]], [6])[0]
    llm.generate([[0, 5]], params, use_tqdm=False, lora_request=other)  # drops "moving" from host memory
    with pytest.raises(ValueError, match="no adapter_config.json"):
        llm.generate([[0, 5, 9]], params, use_tqdm=False, lora_request=lora)
    assert llm.generate([[0, 5, 9]], params, use_tqdm=False)[0].outputs[0].token_ids  # the engine carries on
    assert_all_blocks_free(llm)


def test_adapters_need_enable_lora(model_dir, adapters):
    llm = LLM(model_dir("llama"), dtype="float32", kv_cache_memory_bytes=8 << 20)
    with pytest.raises(ValueError, match="enable_lora"):
        llm.generate([[0, 5]], SamplingParams(max_tokens=2), use_tqdm=False, lora_request=adapters("llama", 8))
    with pytest.raises(ValueError, match="lora_modules: declared adapters need enable_lora"):
        LLM(model_dir("llama"), lora_modules={"a": "/nowhere"})


def test_declared_adapters_are_checked_at_start(model_dir, adapters, tmp_path):
    d = model_dir("llama")
    good = adapters("llama", 8, seed=1)
    llm = lora_llm(d, lora_modules={"mine": good.lora_path})
    out = llm.engine.add_request({"prompt_token_ids": [0, 5]}, SamplingParams(max_tokens=2),
                                 lora_request=llm.engine.input_processor.loras.resolve("mine")[0])
    assert out is not None
    with pytest.raises(ValueError, match="no adapter_config.json"):
        lora_llm(d, lora_modules={"broken": str(tmp_path)})
