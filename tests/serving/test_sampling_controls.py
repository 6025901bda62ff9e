"""Token-level controls through a real tritonserver, in both contracts: vllm_backend's sampling_parameters keys
(logit_bias, allowed_token_ids, bad_words, include_stop_str_in_output) and TensorRT-LLM's bad_words tensor,
each equal to the offline engine's output with the same parameters."""

from __future__ import annotations

import json

import numpy as np
import pytest

import triton_server
from pagedllm import LLM, SamplingParams
from serving_client import grpc_call, grpc_inputs, post

pytestmark = pytest.mark.server

ENGINE = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 32 << 20, "max_num_seqs": 8}
PROMPT = "def fibonacci(n):\n"
BASE = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}

server = triton_server.server_fixture(ENGINE)


@pytest.fixture(scope="module")
def offline(llama_dir):
    return LLM(llama_dir, **ENGINE)


def expected(offline, **params):
    return offline.generate(PROMPT, SamplingParams(**{**BASE, **params}), use_tqdm=False)[0].outputs[0].text


@pytest.mark.parametrize("params", [
    {"logit_bias": {"77": 100}},
    {"allowed_token_ids": [10, 20, 30], "temperature": 1.0, "seed": 4},
    {"bad_words": ["ext", "pat"]},  # words the greedy output has
    {"stop": [" ext"], "include_stop_str_in_output": True},
])
def test_vllm_backend_keys_are_honoured(server, offline, params):
    status, body = post(server, "generate", {"text_input": PROMPT, "exclude_input_in_output": True,
                                             "sampling_parameters": json.dumps({**BASE, **params})})
    assert status == 200, body
    got = json.loads(body)["text_output"]
    assert got == expected(offline, **params) and got != expected(offline)


def test_tensorrt_llm_bad_words_tensor(server, offline):
    words = np.array([b"ext", b"pat"], dtype=np.object_)
    text, err = grpc_call(server, grpc_inputs(PROMPT, BASE, stream=True, bad_words=(words, "BYTES")))
    assert err is None and text == expected(offline, bad_words=["ext", "pat"]) != expected(offline)


def test_out_of_range_values_are_invalid_arg(server):
    status, body = post(server, "generate", {"text_input": PROMPT, "sampling_parameters": json.dumps(
        {"logit_bias": {"5": 1000}})})
    assert status == 400 and "logit_bias" in json.loads(body)["error"]


def test_prompt_logprobs_truncation_and_detokenize_are_honoured(server, offline):
    sp = {**BASE, "prompt_logprobs": 1, "truncate_prompt_tokens": 4, "detokenize": False}
    status, body = post(server, "generate", {"text_input": PROMPT, "exclude_input_in_output": True,
                                             "return_num_input_tokens": True, "return_num_output_tokens": True,
                                             "sampling_parameters": json.dumps(sp)})
    assert status == 200, body
    got = json.loads(body)
    want = offline.generate(PROMPT, SamplingParams(**sp), use_tqdm=False)[0]
    assert got["text_output"] == "" and got["num_output_tokens"] == len(want.outputs[0].token_ids)
    assert got["num_input_tokens"] == 4 and len(want.prompt_token_ids) == 4
    entries = json.loads(got["prompt_logprobs"])
    assert len(entries) == 4 and entries[0] is None
    for entry, ref in zip(entries[1:], want.prompt_logprobs[1:]):
        assert {int(k): v["rank"] for k, v in entry.items()} == {k: v.rank for k, v in ref.items()}


def test_tensorrt_llm_log_probs_and_perf_metrics(server, offline):
    names = ("cum_log_probs", "output_log_probs", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks",
             "arrival_time_ns", "last_token_time_ns")
    flags = {"return_log_probs": (np.array([True]), "BOOL"), "return_perf_metrics": (np.array([True]), "BOOL")}
    text, err, got = grpc_call(server, grpc_inputs(PROMPT, BASE, **flags), outputs=names)
    assert err is None, err
    want = offline.generate(PROMPT, SamplingParams(**BASE, logprobs=0), use_tqdm=False)[0]
    lps = [e[t].logprob for t, e in zip(want.outputs[0].token_ids, want.outputs[0].logprobs)]
    assert list(got["output_log_probs"]) == pytest.approx(lps, abs=1e-4)
    assert float(got["cum_log_probs"]) == pytest.approx(sum(lps), abs=1e-3)
    assert got["kv_cache_alloc_total_blocks"] >= 1 and got["kv_cache_reused_blocks"] >= 0
    assert 0 < got["arrival_time_ns"] <= got["last_token_time_ns"]
