"""A corpus of malformed requests against the real tritonserver: HTTP generate, HTTP generate_stream and gRPC
streaming, through both tensor contracts (vllm_backend's `sampling_parameters` JSON and TensorRT-LLM's tensors).

Each one must get one clear error, naming what is wrong, and cost nothing else: right after it, a normal request
still generates exactly the reference tokens; at the end every KV block is free, the server is alive and nothing
in its log says a response sender was used after its final response.

Most are refused by the model: HTTP 400 (INVALID_ARG), and `pagedllm:requests_rejected_total` counts each one
(over a gRPC stream Triton forwards only the message of an error, so the counter shows it was ours). A few
never reach the model: Triton's own front end refuses a body it cannot parse or a tensor of the wrong type or
shape (HTTP 400, or 500 for its JSON conversion errors, with a one-line message); those are marked TRITON.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

import triton_server
from pagedllm import LLM, SamplingParams
from serving_client import grpc_call, grpc_inputs, post

pytestmark = pytest.mark.server

ENGINE = {"dtype": "float32", "max_model_len": 1024, "kv_cache_memory_bytes": 32 << 20, "max_num_seqs": 16}
GOOD_PROMPT = "def check():"
GOOD = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}
I32, F32, U64 = np.int32, np.float32, np.uint64
BIG = 1_000_000  # beyond any tiny model's vocabulary
TRITON = "refused by Triton's front end"


def sp(**params) -> str:
    return json.dumps(params)


# (name, HTTP body: a dict sent as JSON or raw bytes, what the error must mention)
HTTP_CASES = [
    ("missing text_input", {"sampling_parameters": sp(max_tokens=4)}, "text_input"),
    ("text_input a number", {"text_input": 5}, TRITON),
    ("empty prompt", {"text_input": ""}, "text_input: is empty"),
    ("unknown request parameter", {"text_input": "hi", "frobnicate": 1}, "frobnicate"),
    ("body not JSON", b"{text_input: hi", TRITON),
    ("body a JSON array", b"[1, 2, 3]", TRITON),
    ("sampling_parameters broken JSON", {"text_input": "hi", "sampling_parameters": "{\"max_tokens\": 4,"},
     "not valid JSON"),
    ("sampling_parameters an array", {"text_input": "hi", "sampling_parameters": "[1, 2]"}, "JSON object"),
    ("sampling_parameters nested deep", {"text_input": "hi", "sampling_parameters": "[" * 40 + "]" * 40},
     "nested deeper"),
    ("sampling_parameters 100k deep", {"text_input": "hi", "sampling_parameters": "[" * 100_000}, "bytes of JSON"),
    ("sampling_parameters too large", {"text_input": "hi", "sampling_parameters": sp(stop=["ab"] * 20_000)},
     "bytes of JSON"),
    ("max_tokens of 400 digits", {"text_input": "hi", "sampling_parameters": '{"max_tokens": 1' + "0" * 400 + "}"},
     "max_tokens"),
    ("max_tokens of 5000 digits", {"text_input": "hi", "sampling_parameters": '{"max_tokens": ' + "9" * 5000 + "}"},
     "sampling_parameters"),
    ("temperature Infinity", {"text_input": "hi", "sampling_parameters": '{"temperature": Infinity}'},
     "temperature"),
    ("temperature NaN", {"text_input": "hi", "sampling_parameters": '{"temperature": NaN}'}, "temperature"),
    ("top_p 7", {"text_input": "hi", "sampling_parameters": sp(top_p=7)}, "top_p"),
    ("stop_token_ids outside the vocabulary", {"text_input": "hi",
                                               "sampling_parameters": sp(max_tokens=8, min_tokens=1,
                                                                         stop_token_ids=[BIG])}, "stop_token_ids"),
    ("stop_token_ids negative", {"text_input": "hi", "sampling_parameters": sp(stop_token_ids=[-3])},
     "stop_token_ids"),
    ("max_tokens as words", {"text_input": "hi", "sampling_parameters": sp(max_tokens="many")}, "max_tokens"),
    ("seed 2^64", {"text_input": "hi", "sampling_parameters": sp(seed=2 ** 64)}, "seed"),
    ("seed negative", {"text_input": "hi", "sampling_parameters": sp(seed=-1)}, "seed"),
    ("logprobs over the limit", {"text_input": "hi", "sampling_parameters": sp(logprobs=50)}, "logprobs"),
    ("best_of below n", {"text_input": "hi", "sampling_parameters": sp(n=3, best_of=2)}, "best_of"),
    ("too many stop strings", {"text_input": "hi", "sampling_parameters": sp(stop=[f"s{i}" for i in range(40)])},
     "stop"),
    ("stop string too long", {"text_input": "hi", "sampling_parameters": sp(stop=["x" * 300])}, "stop"),
    ("prompt past the context", {"text_input": "x " * 3000}, "prompt"),
    ("trtllm end_id outside the vocabulary", {"text_input": "hi", "end_id": BIG, "min_length": 1, "max_tokens": 8},
     "stop_token_ids"),
    ("trtllm pad_id outside the vocabulary", {"text_input": "hi", "pad_id": BIG, "max_tokens": 8}, "pad_id"),
    ("trtllm beam search sampled", {"text_input": "hi", "beam_width": 4, "temperature": 0.5}, "temperature"),
    ("trtllm beam search streamed", {"text_input": "hi", "beam_width": 4, "stream": True}, "beam"),
    ("trtllm max_tokens a word", {"text_input": "hi", "max_tokens": "ten"}, TRITON),
    ("trtllm temperature negative", {"text_input": "hi", "temperature": -1.0}, "temperature"),
    ("trtllm timeout zero", {"text_input": "hi", "timeout": 0.0}, "timeout"),
]

# (name, gRPC inputs, what the error must mention)
GRPC_CASES = [
    ("missing text_input", lambda: grpc_inputs(None, {"max_tokens": 4}), "text_input"),
    ("non-UTF-8 prompt", lambda: grpc_inputs(b"\xff\xfe\xfa", None), "UTF-8"),
    ("non-UTF-8 sampling_parameters", lambda: grpc_inputs("hi", b'{"stop": ["\xff"]}'), "UTF-8"),
    ("two prompts in one tensor", lambda: _two_prompts(), TRITON),
    ("text_input as INT32", lambda: grpc_inputs(None, None, text_input=(np.array([7], dtype=I32), "INT32")),
     TRITON),
    ("unknown input tensor", lambda: grpc_inputs("hi", None, bogus=(np.array([1], dtype=I32), "INT32")), TRITON),
    ("JSON not an object", lambda: grpc_inputs("hi", "17"), "JSON object"),
    ("unknown parameter", lambda: grpc_inputs("hi", {"max_tokenz": 4}), "max_tokenz"),
    ("max_tokens fractional", lambda: grpc_inputs("hi", {"max_tokens": 2.5}), "max_tokens"),
    ("min_tokens above max_tokens", lambda: grpc_inputs("hi", {"max_tokens": 2, "min_tokens": 5}), "min_tokens"),
    ("n above its bound", lambda: grpc_inputs("hi", {"n": 300}), "n:"),
    ("n above max_num_seqs", lambda: grpc_inputs("hi", {"n": 200}), "max_num_seqs"),
    ("stop of the wrong type", lambda: grpc_inputs("hi", {"stop": [3]}), "stop"),
    ("tensor max_tokens zero", lambda: grpc_inputs("hi", None, max_tokens=(np.array([0], dtype=I32), "INT32")),
     "max_tokens"),
    ("tensor min_length past max_tokens", lambda: grpc_inputs(
        "hi", None, max_tokens=(np.array([2], dtype=I32), "INT32"), min_length=(np.array([9], dtype=I32), "INT32")),
     "min_tokens"),
    ("tensor end_id outside the vocabulary", lambda: grpc_inputs(
        "hi", None, end_id=(np.array([BIG], dtype=I32), "INT32"), min_length=(np.array([1], dtype=I32), "INT32")),
     "stop_token_ids"),
    ("tensor end_id negative", lambda: grpc_inputs("hi", None, end_id=(np.array([-1], dtype=I32), "INT32")),
     "stop_token_ids"),
    ("tensor temperature infinite", lambda: grpc_inputs(
        "hi", None, temperature=(np.array([np.inf], dtype=F32), "FP32")), "temperature"),
    ("tensor top_p NaN", lambda: grpc_inputs("hi", None, top_p=(np.array([np.nan], dtype=F32), "FP32")), "top_p"),
    ("tensor bad_words not UTF-8", lambda: grpc_inputs(
        "hi", None, bad_words=(np.array([b"\xff"], dtype=np.object_), "BYTES")), "bad_words"),
    ("tensor stop_words not UTF-8", lambda: grpc_inputs(
        "hi", None, stop_words=(np.array([b"\xc3\x28"], dtype=np.object_), "BYTES")), "UTF-8"),
    ("tensor priority of the wrong type", lambda: grpc_inputs(
        "hi", None, priority=(np.array([1.5], dtype=F32), "FP32")), TRITON),
    ("tensor timeout infinite", lambda: grpc_inputs("hi", None, timeout=(np.array([np.inf], dtype=F32), "FP32")),
     "timeout"),
    ("tensor pad_id outside the vocabulary", lambda: grpc_inputs(
        "hi", None, pad_id=(np.array([BIG], dtype=I32), "INT32")), "pad_id"),
    ("tensor stream not a bool", lambda: grpc_inputs(
        "hi", None, exclude_input_in_output=(np.array([1], dtype=I32), "INT32")), TRITON),
]


def _two_prompts():
    inputs = grpc_inputs(None, None)
    t = grpcclient.InferInput("text_input", [2], "BYTES")
    t.set_data_from_numpy(np.array([b"a", b"b"], dtype=np.object_))
    return [t, *inputs]


server = triton_server.server_fixture(ENGINE)


@pytest.fixture(scope="module")
def expected(llama_dir):
    llm = LLM(llama_dir, **ENGINE)
    return llm.generate(GOOD_PROMPT, SamplingParams(**GOOD), use_tqdm=False)[0].outputs[0].text


def _http_error(server, path: str, body) -> tuple[int, str]:
    """(status, error text) of a request expected to fail: a 400 before anything streams, or (SSE) an error
    event as the stream's only event."""
    if path == "generate_stream" and isinstance(body, dict):
        body = {**body, "stream": True}
    status, text = post(server, path, body)
    if status == 200 and path == "generate_stream":
        events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
        assert len(events) == 1 and "error" in events[0], text
        return 400, events[0]["error"]
    return status, text


def _good_over_http(server, expected):
    status, text = post(server, "generate", {"text_input": GOOD_PROMPT, "exclude_input_in_output": True,
                                             "sampling_parameters": json.dumps(GOOD)})
    assert status == 200, text
    assert json.loads(text)["text_output"] == expected


def _rejected(server) -> float:
    return server.scrape().get("pagedllm:requests_rejected_total", 0.0)


def _check_refusal(server, error: str, mention: str, rejected_before: float) -> None:
    """A clear one-line error; counted as rejected by the model unless Triton refused it first."""
    assert error and "Traceback" not in error and "\n" not in error.strip(), error
    if mention == TRITON:
        assert server.scrape().get("pagedllm:requests_rejected_total", 0.0) == rejected_before
    else:
        assert mention in error, error
        m = server.wait_metrics(lambda m: m.get("pagedllm:requests_rejected_total", 0.0) == rejected_before + 1)
        assert m["pagedllm:requests_rejected_total"] == rejected_before + 1


@pytest.mark.parametrize("path", ["generate", "generate_stream"])
@pytest.mark.parametrize("case", HTTP_CASES, ids=[c[0] for c in HTTP_CASES])
def test_http_request_is_refused_clearly_and_costs_nothing_else(server, expected, case, path):
    _, body, mention = case
    before = _rejected(server)
    status, error = _http_error(server, path, body)
    assert status == 400 or (mention == TRITON and status == 500), (status, error)
    _check_refusal(server, error, mention, before)
    _good_over_http(server, expected)


@pytest.mark.parametrize("case", GRPC_CASES, ids=[c[0] for c in GRPC_CASES])
def test_grpc_request_is_refused_clearly_and_costs_nothing_else(server, expected, case):
    _, make_inputs, mention = case
    before = _rejected(server)
    _, error = grpc_call(server, make_inputs())
    assert error is not None
    _check_refusal(server, error, mention, before)
    text, error = grpc_call(server, grpc_inputs(GOOD_PROMPT, GOOD, stream=True))
    assert error is None and text == expected


def test_the_corpus_is_large_enough():
    assert 2 * len(HTTP_CASES) + len(GRPC_CASES) >= 60


def test_afterwards_every_block_is_free_and_the_server_never_misused_a_sender(server):
    m = server.wait_metrics(server.all_blocks_free)
    assert server.all_blocks_free(m)
    assert server.proc.poll() is None
    log = server.log.read_text()
    assert "Response sender has been closed" not in log and "after the final one" not in log
    assert "Signal (11)" not in log
