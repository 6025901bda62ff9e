"""The Triton tensor contract, parsed without Triton: both anchors' inputs and their errors."""

import json

import numpy as np
import pytest

from pagedllm.serving.request_parser import InvalidRequest, parse_request


def t(value, dtype=None):
    if isinstance(value, str):
        return np.array([value.encode()], dtype=np.object_)
    return np.array([value], dtype=dtype)


def test_vllm_backend_contract_with_string_numbers():
    sp = json.dumps({"max_tokens": "128", "min_tokens": "128", "temperature": "0.7", "top_p": 0.9,
                     "ignore_eos": "true", "stop": "END", "seed": 3})
    p = parse_request({"text_input": t("hello"), "stream": t(True), "sampling_parameters": t(sp),
                       "exclude_input_in_output": t(True), "return_finish_reason": t(True)})
    assert p.prompt == "hello" and p.stream and p.exclude_input_in_output
    assert p.params.max_tokens == 128 and p.params.min_tokens == 128 and p.params.temperature == 0.7
    assert p.params.ignore_eos is True and p.params.stop == ["END"] and p.params.seed == 3
    assert p.returns == {"finish_reason"}


def test_tensorrt_llm_contract():
    p = parse_request({"text_input": t("hi"), "max_tokens": t(16, np.int32), "min_length": t(4, np.int32),
                       "temperature": t(0.5, np.float32), "runtime_top_k": t(5, np.int32),
                       "random_seed": t(11, np.uint64), "stop_words": np.array([b"a", b"bb"], dtype=np.object_),
                       "end_id": t(1, np.int32), "return_log_probs": t(True), "beam_width": t(1, np.int32)})
    sp = p.params
    assert (sp.max_tokens, sp.min_tokens, sp.top_k, sp.seed) == (16, 4, 5, 11)
    assert sp.temperature == pytest.approx(0.5) and sp.stop == ["a", "bb"] and sp.stop_token_ids == [1]
    assert sp.logprobs == 0 and "cumulative_logprob" in p.returns


def test_tensors_override_json_and_request_parameters_are_read():
    p = parse_request({"text_input": t("hi"), "sampling_parameters": t('{"max_tokens": 9, "top_k": 3}'),
                       "max_tokens": t(4, np.int32)}, parameters={"top_k": 7, "temperature": 0})
    assert p.params.max_tokens == 4 and p.params.top_k == 3 and p.params.temperature == 0


def test_the_heartbeat_parameter_is_read_apart_from_the_sampling_ones():
    p = parse_request({"text_input": t("hi")}, parameters={"heartbeat": True, "top_k": 7})
    assert p.heartbeat and p.params.top_k == 7
    assert not parse_request({"text_input": t("hi")}).heartbeat
    with pytest.raises(InvalidRequest, match="heartbeat: must be a boolean"):
        parse_request({"text_input": t("hi")}, parameters={"heartbeat": "yes"})


@pytest.mark.parametrize("inputs, params, message", [
    ({}, None, "text_input or messages: exactly one is required"),
    ({"text_input": t("")}, None, "text_input: is empty"),
    ({"text_input": np.array([b"\xff"], dtype=np.object_)}, None, "UTF-8"),
    ({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, None, "exactly one element"),
    ({"text_input": t("x"), "sampling_parameters": t("{")}, None, "not valid JSON"),
    ({"text_input": t("x"), "sampling_parameters": t('{"max_tokens": "lots"}')}, None, "max_tokens"),
    ({"text_input": t("x"), "sampling_parameters": t('{"max_tokens": true}')}, None, "max_tokens"),
    ({"text_input": t("x"), "sampling_parameters": t('{"ignore_eos": "maybe"}')}, None, "ignore_eos"),
    ({"text_input": t("x"), "nonsense": t(1, np.int32)}, None, "unknown input"),
    ({"text_input": t("x"), "stream": t(1, np.int32)}, None, "stream: expected a boolean"),
    ({"text_input": t("x"), "max_tokens": t("3")}, None, "expected a number"),
    ({"text_input": t("x")}, {"bogus": 1}, "request parameters: unknown parameter 'bogus'"),
    ({"text_input": t("x"), "priority": t(1.5, np.float32)}, None, "priority"),
])
def test_errors_name_the_problem(inputs, params, message):
    with pytest.raises(InvalidRequest, match=message):
        parse_request(inputs, params)


def test_queued_outputs_of_one_request_are_merged_in_order():
    from pagedllm.outputs import CompletionOutput, RequestOutput
    from pagedllm.serving.response_builder import coalesce

    def out(rid, delta, toks, finished=False):  # DELTA outputs: each holds only what is new
        c = CompletionOutput(0, delta, toks, 0.0, None, "length" if finished else None)
        return RequestOutput(rid, "p", [1], [c], finished)

    items = [("a", out("a", "x", [1]), None), ("b", out("b", "q", [9]), None), ("a", out("a", "y", [2]), None),
             ("a", out("a", "z", [3], True), None)]
    merged = coalesce(items)
    assert [m[0] for m in merged] == ["b", "a"]
    a = merged[1][1]
    assert a.outputs[0].text == "xyz" and a.outputs[0].token_ids == [1, 2, 3] and a.finished
    err = RuntimeError("boom")
    assert coalesce([("a", out("a", "x", [1]), None), ("a", None, err)]) == [("a", None, err)]


def test_token_controls_and_prompt_options_reach_sampling_params():
    sp = json.dumps({"logit_bias": {"5": "2.5", "7": -100}, "allowed_token_ids": [1, 2, 3], "bad_words": "foo",
                     "include_stop_str_in_output": "true", "truncate_prompt_tokens": "8", "prompt_logprobs": 2,
                     "detokenize": False, "best_of": 1, "spaces_between_special_tokens": True})
    p = parse_request({"text_input": t("hi"), "sampling_parameters": t(sp),
                       "bad_words": np.array([b"bar", b""], dtype=np.object_)}).params
    assert p.logit_bias == {5: 2.5, 7: -100.0} and p.allowed_token_ids == [1, 2, 3]
    assert p.bad_words == ["foo", "bar"] and p.include_stop_str_in_output is True
    assert (p.truncate_prompt_tokens, p.prompt_logprobs, p.detokenize) == (8, 2, False)
    nulls = parse_request({"text_input": t("hi"), "sampling_parameters": t(json.dumps(
        {"truncate_prompt_tokens": None, "prompt_logprobs": None, "logit_bias": None}))}).params
    assert (nulls.truncate_prompt_tokens, nulls.prompt_logprobs, nulls.logit_bias) == (None, None, None)


def test_tensorrt_llm_return_flags():
    p = parse_request({"text_input": t("hi"), "return_log_probs": t(True), "return_perf_metrics": t(True)})
    assert {"cum_log_probs", "output_log_probs", "perf_metrics"} <= p.returns and p.params.logprobs == 0


@pytest.mark.parametrize("sp, message", [
    ({"n": 0}, r"n: must be an integer in \[1, 256\]"),
    ({"n": 2, "best_of": 1}, r"best_of: must be an integer in \[n, 256\]"),
    ({"spaces_between_special_tokens": False}, "spaces_between_special_tokens: only True is supported"),
    ({"logit_bias": [1, 2]}, "logit_bias: expected an object"),
    ({"logit_bias": {"x": 1}}, "logit_bias: expected an integer"),
    ({"logit_bias": {"5": 101}}, r"logit_bias: must map token ids to numbers in \[-100, 100\]"),
    ({"allowed_token_ids": []}, "allowed_token_ids: must be a non-empty list"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"detokenize": False, "stop": ["x"]}, "stop strings need detokenize=True"),
    ({"logits_processors": ["f"]}, "unknown parameter 'logits_processors'"),
])
def test_vllm_keys_out_of_reach_are_refused_by_name(sp, message):
    with pytest.raises(InvalidRequest, match=message):
        parse_request({"text_input": t("x"), "sampling_parameters": t(json.dumps(sp))})


def test_tensorrt_llm_log_probs_and_perf_metrics_outputs():
    from pagedllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
    from pagedllm.serving.response_builder import ResponseBuilder

    p = parse_request({"text_input": t("hi"), "return_log_probs": t(True), "return_perf_metrics": t(True),
                       "exclude_input_in_output": t(True)})
    lps = [{4: Logprob(-0.5, 1)}, {9: Logprob(-1.25, 2)}]
    c = CompletionOutput(0, "ab", [4, 9], -1.75, lps, "length")
    metrics = RequestMetrics(100.0, 100.5, 101.0, 102.0, 102.0, num_draft_tokens=8,
                             num_accepted_draft_tokens=6)
    out = RequestOutput("r", "hi", list(range(20)), [c], True, num_cached_tokens=16, metrics=metrics,
                        prompt_logprobs=[None, {3: Logprob(-2.0, 5, "x")}])
    arrays = ResponseBuilder(p, 20, block_size=16).arrays_for(out)
    assert arrays["cum_log_probs"].dtype == np.float32 and arrays["cum_log_probs"].tolist() == [-1.75]
    assert arrays["output_log_probs"].shape == (1, 2) and arrays["output_log_probs"].tolist() == [[-0.5, -1.25]]
    # 22 tokens in blocks of 16: 2 blocks, one of them reused from the prefix cache
    assert (arrays["kv_cache_reused_blocks"][0], arrays["kv_cache_alloc_new_blocks"][0],
            arrays["kv_cache_alloc_total_blocks"][0]) == (1, 1, 2)
    times = [int(arrays[n][0]) for n in ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns",
                                         "last_token_time_ns")]
    assert times == sorted(times) and times[3] - times[0] == pytest.approx(2e9, rel=1e-3)
    assert (arrays["total_draft_tokens"][0], arrays["total_accepted_draft_tokens"][0]) == (8, 6)
    assert arrays["acceptance_rate"].dtype == np.float32 and arrays["acceptance_rate"][0] == 0.75
    assert json.loads(arrays["prompt_logprobs"][0]) == [None, {"3": {"logprob": -2.0, "rank": 5,
                                                                      "decoded_token": "x"}}]
