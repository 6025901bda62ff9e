"""n, best_of and beam search through a real tritonserver, in both contracts: every sequence comes back, each
response's `sequence_index` says whose element is whose (a stream's deltas too), equal to the offline engine."""

from __future__ import annotations

import json
import queue

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

import triton_server
from pagedllm import LLM, BeamSearchParams, SamplingParams
from serving_client import grpc_inputs, post

pytestmark = pytest.mark.server

ENGINE = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 32 << 20, "max_num_seqs": 8}
PROMPT = "def fibonacci(n):\n"
SAMPLED = {"temperature": 1.0, "seed": 17, "max_tokens": 20, "ignore_eos": True}

server = triton_server.server_fixture(ENGINE)


@pytest.fixture(scope="module")
def offline(llama_dir):
    return LLM(llama_dir, **ENGINE)


def stream_by_index(server, inputs) -> tuple[dict[int, str], int]:
    """A gRPC stream's deltas joined per sequence_index, and how many responses carried text."""
    got = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer("pagedllm", inputs, enable_empty_final_response=True)
    texts: dict[int, str] = {}
    responses = 0
    try:
        while True:
            res, err = got.get(timeout=60)
            assert err is None, err
            text, index = res.as_numpy("text_output"), res.as_numpy("sequence_index")
            if text is not None:
                responses += 1
                for t, i in zip(text, index):
                    texts[int(i)] = texts.get(int(i), "") + t.decode()
            final = res.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return texts, responses
    finally:
        client.stop_stream()
        client.close()


def test_streamed_samples_name_their_index(server, offline):
    texts, responses = stream_by_index(server, grpc_inputs(PROMPT, {**SAMPLED, "n": 3}, stream=True))
    want = offline.generate(PROMPT, SamplingParams(n=3, **SAMPLED), use_tqdm=False)[0].outputs
    assert [texts[i] for i in range(3)] == [c.text for c in want]
    assert responses > 3  # deltas, not one response per sample
    assert server.all_blocks_free(server.wait_metrics(server.all_blocks_free))


def test_http_generate_returns_every_sample_and_the_best_of(server, offline):
    status, body = post(
        server,
        "generate",
        {
            "text_input": PROMPT,
            "exclude_input_in_output": True,
            "return_finish_reason": True,
            "sampling_parameters": json.dumps({**SAMPLED, "n": 2, "best_of": 4}),
        },
    )
    assert status == 200, body
    got = json.loads(body)
    want = offline.generate(PROMPT, SamplingParams(n=2, best_of=4, **SAMPLED), use_tqdm=False)[0].outputs
    assert got["text_output"] == [c.text for c in want] and got["sequence_index"] == [0, 1]
    assert got["finish_reason"] == ["length", "length"]


def test_tensorrt_llm_beam_width_returns_the_beams(server, offline):
    def tensor(value, dtype, kind):
        return np.array([value], dtype=dtype), kind

    inputs = grpc_inputs(
        PROMPT,
        None,
        max_tokens=tensor(16, np.int32, "INT32"),
        beam_width=tensor(4, np.int32, "INT32"),
        length_penalty=tensor(0.5, np.float32, "FP32"),
        return_log_probs=tensor(True, bool, "BOOL"),
        exclude_input_in_output=tensor(True, bool, "BOOL"),
    )
    got = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer("pagedllm", inputs)
    try:
        res, err = got.get(timeout=60)
    finally:
        client.stop_stream()
        client.close()
    assert err is None, err
    want = offline.beam_search(PROMPT, BeamSearchParams(beam_width=4, max_tokens=16, length_penalty=0.5))[
        0
    ].outputs
    assert [t.decode() for t in res.as_numpy("text_output")] == [c.text for c in want]
    assert list(res.as_numpy("sequence_index")) == [0, 1, 2, 3]
    assert res.as_numpy("cum_log_probs") == pytest.approx([c.cumulative_logprob for c in want], abs=1e-3)
    assert res.as_numpy("output_log_probs").shape == (4, 16)
    assert server.all_blocks_free(server.wait_metrics(server.all_blocks_free))
