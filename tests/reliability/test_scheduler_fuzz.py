"""Property-based fuzzing (hypothesis) of continuous batching through the offline engine: whatever mix of requests
(lengths, greedy, seeded samples, best_of, beams wider than the pool; logprobs, penalties, min_tokens, prompt
logprobs, stop strings, grammars; streamed as deltas, cumulative or final only; adapters; priorities, arrivals
mid-batch, aborts) meets whatever small KV pool and scheduling options (capacity policy, FCFS or priority, chunked
prefill, prefix caching, n-gram speculation, LoRA with fewer slots than adapters), every request ends within a
bounded number of steps with the tokens it gets alone on an ample pool without speculation, and every block is
back in the pool. What it found: wide beams that never finished (an idle beam yielded its blocks and took them
straight back), best_of's cumulative outputs that held every sample, and seeded samples whose tokens changed with
the drafts the token budget left them."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conftest import assert_all_blocks_free, random_prompts
from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from pagedllm.tiny_model import first_layers_model, make_lora_adapter

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 128  # 8 blocks of 16: the smallest pool drawn (10 blocks) still holds any one sequence
BASE = dict(dtype="float32", max_model_len=MAX_MODEL_LEN)
NUM_ADAPTERS = 3
FILTERS = st.sampled_from([{}, {}, {"top_k": 5}, {"top_p": 0.8}, {"min_p": 0.1}, {"top_k": 20, "top_p": 0.9}])
GRAMMARS = st.sampled_from([
    StructuredOutputsParams(choice=["yes", "no", "maybe not"]),
    StructuredOutputsParams(regex="[a-z]{2,12}( [0-9]+)?"),
    StructuredOutputsParams(json={"type": "object", "properties": {"n": {"type": "integer"}}}),
])


@st.composite
def requests(draw):
    """One request: its prompt, parameters, priority, the step it arrives at and the step it is aborted at."""
    prompt_len = draw(st.integers(1, 100))
    # mostly short; some long enough for the random model to fall into loops, which prompt lookup then predicts
    max_tokens = draw(st.integers(1, min(draw(st.sampled_from([40, 40, 100])), MAX_MODEL_LEN - prompt_len)))
    kind = draw(st.sampled_from(["greedy", "samples", "best_of", "beams", "constrained"]))
    common = dict(max_tokens=max_tokens, ignore_eos=draw(st.booleans()))
    if kind != "beams":  # what keeps a request off speculation, or off the prefix cache (prompt logprobs)
        # streamed as deltas (as Triton streams), whole so far, or at the end only (best_of > n cannot stream)
        kinds = list(RequestOutputKind)
        if kind == "best_of":
            kinds.remove(RequestOutputKind.DELTA)
        common.update(output_kind=draw(st.sampled_from(kinds)),
                      stop=draw(st.sampled_from([[], [], ["e"], ["an", "o"]])),
                      logprobs=draw(st.sampled_from([None, None, 0, 2])),
                      min_tokens=draw(st.sampled_from([0, 0, min(3, max_tokens)])),
                      repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.3])),
                      prompt_logprobs=draw(st.sampled_from([None, None, 1])))
    if kind == "greedy":
        params = SamplingParams(temperature=0, **common)
    elif kind == "constrained":  # a grammar: one sequence, never speculated
        common.update(min_tokens=0, ignore_eos=False)  # the grammar decides where the output ends
        params = SamplingParams(temperature=draw(st.sampled_from([0, 1.0])), seed=draw(st.integers(0, 99)),
                                structured_outputs=draw(GRAMMARS), **common)
    elif kind == "samples":  # n of 1 too: a lone seeded sample, the kind speculation serves
        params = SamplingParams(n=draw(st.integers(1, 6)), temperature=draw(st.sampled_from([0.7, 1.0])),
                                seed=draw(st.integers(0, 99)), **draw(FILTERS), **common)
    elif kind == "best_of":
        params = SamplingParams(n=1, best_of=draw(st.integers(2, 4)), temperature=1.0,
                                seed=draw(st.integers(0, 99)), **common)
    else:
        width = draw(st.integers(2, 12))
        params = SamplingParams(beam_width=width, n=width, temperature=0, **common)
    abort_at = draw(st.none() | st.integers(0, 30))
    prompt = random_prompts([prompt_len], seed=draw(st.integers(0, 10 ** 6)))[0]
    if draw(st.booleans()):  # a prompt that repeats itself: prompt lookup finds drafts, and some are accepted
        prompt = (prompt * (1 + 24 // prompt_len))[:max(prompt_len, 24)][:MAX_MODEL_LEN - max_tokens]
    return dict(prompt=prompt, params=params,
                priority=draw(st.integers(-2, 2)), arrive_at=draw(st.integers(0, 12)), abort_at=abort_at,
                adapter=draw(st.none() | st.integers(0, NUM_ADAPTERS - 1)))  # used where the engine has LoRA


engine_options = st.fixed_dictionaries({
    "kv_cache_memory_bytes": st.integers(10, 24).map(lambda blocks: (blocks + 1) * 16384),  # one block is held back
    "capacity_scheduler_policy": st.sampled_from(["max_utilization", "guaranteed_no_evict"]),
    "scheduling_policy": st.sampled_from(["fcfs", "priority"]),
    "enable_chunked_prefill": st.booleans(),
    "enable_prefix_caching": st.booleans(),
    "max_num_batched_tokens": st.sampled_from([32, 128, 512]),
    "max_num_seqs": st.sampled_from([4, 16, 64]),
    "speculative_config": st.none() | st.just({"method": "ngram", "num_speculative_tokens": 3}),
    "max_loras": st.sampled_from([0, 0, 1, 2]),  # 0: LoRA off; else adapters running at once, at most
})


def _alone(reference, request: dict, lora) -> list[list[int]]:
    """The request's sequences' tokens when it runs alone on an ample pool."""
    out = reference.generate([{"prompt_token_ids": request["prompt"]}], request["params"], use_tqdm=False,
                             lora_request=lora)[0]
    return [c.token_ids for c in out.outputs]


def _step_bound(reqs: list[dict]) -> int:
    """Generous, yet finite: every sequence recomputed from scratch for each of its tokens would stay under it."""
    return 200 + sum(r["params"].num_sequences * (len(r["prompt"]) + r["params"].max_tokens) * 4 for r in reqs)


@pytest.fixture(scope="module")
def reference(model_dir):
    """reference(lora) -> an ample pool, no speculation (verification draws a seeded sample's tokens as plain
    decoding does), with LoRA (a slot for every adapter) or without."""
    made = {}

    def get(lora: bool):
        if lora not in made:
            extra = dict(enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=8) if lora else {}
            made[lora] = LLM(model_dir("llama"), kv_cache_memory_bytes=64 << 20, **BASE, **extra)
        return made[lora]

    return get


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):
    out = []
    for k in range(NUM_ADAPTERS):
        path = make_lora_adapter(model_dir("llama"), str(tmp_path_factory.mktemp(f"fuzz_lora{k}")), rank=8, seed=k)
        out.append(LoRARequest(f"fuzz{k}", k + 1, path))
    return out


SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@st.composite
def speculated_requests(draw):
    """Requests that prompt lookup serves: greedy or lone seeded samples (with top-k / top-p / min-p), prompts
    that repeat themselves, outputs long enough for the random model to loop."""
    prompt_len = draw(st.integers(2, 30))
    prompt = random_prompts([prompt_len], seed=draw(st.integers(0, 10 ** 6)))[0] * draw(st.integers(1, 3))
    max_tokens = draw(st.integers(1, MAX_MODEL_LEN - len(prompt)))
    sampled = draw(st.booleans())
    params = SamplingParams(temperature=draw(st.sampled_from([0.7, 1.0])) if sampled else 0,
                            seed=draw(st.integers(0, 99)) if sampled else None,
                            **(draw(FILTERS) if sampled else {}), max_tokens=max_tokens, ignore_eos=True,
                            output_kind=draw(st.sampled_from(list(RequestOutputKind))))
    return dict(prompt=prompt, params=params, priority=draw(st.integers(-1, 1)), arrive_at=draw(st.integers(0, 20)),
                abort_at=draw(st.none() | st.integers(0, 60)), adapter=None)


@SETTINGS
@given(options=engine_options, reqs=st.lists(requests(), min_size=1, max_size=6))
def test_any_mix_of_requests_ends_with_its_tokens_and_every_block_back(model_dir, reference, adapters, options,
                                                                       reqs):
    run_mix(model_dir, reference, adapters, options, reqs)


@settings(SETTINGS, max_examples=80)
@given(options=engine_options.map(lambda o: {**o, "speculative_config": {"method": "ngram",
                                                                          "num_speculative_tokens": 3}}),
       reqs=st.lists(speculated_requests(), min_size=1, max_size=6))
def test_speculation_under_any_load_gives_the_tokens_of_plain_decoding(model_dir, reference, adapters, options,
                                                                       reqs):
    """However the token budget, preemption and other requests trim a request's drafts, greedy and seeded
    requests get the tokens of plain decoding."""
    run_mix(model_dir, reference, adapters, options, reqs)


@pytest.fixture(scope="module")
def draft_dir(model_dir, tmp_path_factory):
    return first_layers_model(model_dir("llama"), str(tmp_path_factory.mktemp("fuzz_draft")), 1)


@settings(SETTINGS, max_examples=60)
@given(options=engine_options, reqs=st.lists(speculated_requests(), min_size=1, max_size=6))
def test_a_draft_model_under_any_load_finishes_everything(model_dir, reference, adapters, draft_dir, options, reqs):
    """A draft model (its own small block pool) under any budget, pool and load: greedy requests get the tokens of
    plain decoding; sampled ones (rejection-sampled drafts: other tokens, the same distribution) their full length;
    both pools end empty."""
    options = {**options, "speculative_config": {"method": "draft_model", "model": draft_dir,
                                                 "num_speculative_tokens": 3}}
    llm = run_mix(model_dir, reference, adapters, options, reqs, exact=lambda r: r["params"].temperature == 0)
    assert llm.engine.proposer.kv.all_free()


def run_mix(model_dir, reference, adapters, options: dict, reqs: list[dict], exact=lambda r: True) -> LLM:
    """Run the requests on an engine with these options, each arriving (and aborted) at its step, to the end;
    then check the step bound, the pool and each request's tokens against the same request alone (for requests
    that are not `exact`, their lengths). Returns the engine."""
    if options["enable_chunked_prefill"] is False:
        options = {**options, "max_num_batched_tokens": max(options["max_num_batched_tokens"], MAX_MODEL_LEN)}
    max_loras = options.pop("max_loras")
    if max_loras:
        options.update(enable_lora=True, max_loras=max_loras, max_lora_rank=8)
    lora_of = {i: adapters[r["adapter"]] if max_loras and r["adapter"] is not None else None
               for i, r in enumerate(reqs)}
    llm = LLM(model_dir("llama"), **BASE, **options)
    engine = llm.engine
    ids: dict[int, str] = {}  # request index -> its id, once added
    got: dict[str, dict[int, list[int]]] = {}  # request id -> each sequence's tokens as its outputs tell them
    refused, aborted, index_of = set(), set(), {}
    step, bound = 0, _step_bound(reqs)
    while len(ids) + len(refused) < len(reqs) or engine.has_unfinished_requests():
        for i, r in enumerate(reqs):
            if r["arrive_at"] == step:
                prompt = {"prompt_token_ids": r["prompt"]}
                kw = dict(priority=r["priority"], lora_request=lora_of[i])
                if r["params"].num_sequences > options["max_num_seqs"]:
                    with pytest.raises(ValueError, match="max_num_seqs"):
                        engine.add_request(prompt, r["params"], **kw)
                    refused.add(i)
                    continue
                ids[i] = engine.add_request(prompt, r["params"], **kw)
                index_of[ids[i]] = i
            if i in ids and r["abort_at"] is not None and r["arrive_at"] + r["abort_at"] == step:
                out = engine.abort_request(ids[i])
                if out is not None:  # it was still running: its tokens so far
                    aborted.add(i)
                    _collect(got, out, r["params"])
        for out in engine.step():
            _collect(got, out, reqs[index_of[out.request_id]]["params"])
        step += 1
        assert step <= bound, f"still running after {step} steps ({llm.get_stats().num_preemptions} preemptions)"
    assert_all_blocks_free(llm)
    event(f"preempted: {llm.get_stats().num_preemptions > 0}")
    event(f"aborted while running: {bool(aborted)}")
    if options["speculative_config"]:
        event(f"drafts accepted: {llm.get_stats().spec_decode_num_accepted_tokens > 0}")
    event(f"adapters in use: {len({lora_of[i].lora_int_id for i in ids if lora_of[i] is not None})}, "
          f"slots: {max_loras}")
    for i, r in enumerate(reqs):
        if i in refused:
            continue
        alone = _alone(reference(bool(max_loras)), r, lora_of[i])
        mine = [got[ids[i]][k] for k in sorted(got.get(ids[i], {}))]
        if not exact(r):
            if i not in aborted:
                assert [len(t) for t in mine] == [len(t) for t in alone], (i, r)
            continue
        if i not in aborted:
            assert mine == alone, (i, r)
        elif r["params"].beam_width == 1 and r["params"].best_of is None:  # a beam's or best-of's may yet change
            for part, whole in zip(mine, alone):
                assert part == whole[:len(part)], (i, r)
    return llm


def _collect(got: dict, out, params: SamplingParams) -> None:
    """Each sequence's tokens from one output: deltas add up; a cumulative or final output holds them all."""
    seqs = got.setdefault(out.request_id, {})
    if params.output_kind != RequestOutputKind.DELTA:
        seqs.clear()
    for c in out.outputs:
        seqs[c.index] = seqs.get(c.index, []) + list(c.token_ids)
