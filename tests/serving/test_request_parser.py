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
