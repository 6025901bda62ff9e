"""Structured output through a real tritonserver, in both contracts: vllm_backend's `structured_outputs` and
`guided_decoding` in sampling_parameters, TensorRT-LLM's guided_decoding_guide_type + guided_decoding_guide
tensors; an invalid spec is an INVALID_ARG naming it; outputs equal offline ones."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import triton_server
from pagedllm import LLM, SamplingParams
from serving_client import grpc_call, grpc_inputs, post

pytestmark = pytest.mark.server

ENGINE = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 32 << 20, "max_num_seqs": 16}
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "kind": {"enum": ["cat", "dog"]}},
          "required": ["id", "kind"], "additionalProperties": False}
REGEX = r"[A-Z][a-z]{1,6} [0-9]{2}"

server = triton_server.server_fixture(ENGINE)


@pytest.fixture(scope="module")
def offline(llama_dir):
    return LLM(llama_dir, **ENGINE)


def _text(arr) -> tuple[str, np.ndarray]:
    return np.array([arr.encode()], dtype=np.object_), "BYTES"


@pytest.mark.parametrize("key, backend", [("structured_outputs", None), ("guided_decoding", None),
                                          ("guided_decoding", "xgrammar"), ("structured_outputs", "guidance")])
def test_vllm_backend_keys(server, offline, key, backend):
    """Either grammar engine, named in the request or not (the default: guidance), gives the offline text."""
    spec = {"json": SCHEMA, "backend": backend}
    sampling = {"temperature": 1.0, "seed": 3, "max_tokens": 64, key: spec}
    status, body = post(server, "generate", {"text_input": "def f():", "exclude_input_in_output": True,
                                             "sampling_parameters": json.dumps(sampling)})
    assert status == 200, body
    text = json.loads(body)["text_output"]
    got = json.loads(text)
    assert set(got) == {"id", "kind"} and got["kind"] in ("cat", "dog")
    expected = offline.generate("def f():", SamplingParams(temperature=1.0, seed=3, max_tokens=64,
                                                           structured_outputs=spec), use_tqdm=False)
    assert text == expected[0].outputs[0].text


@pytest.mark.parametrize("guide_type, guide, check", [
    ("json_schema", json.dumps(SCHEMA), lambda t: set(json.loads(t)) == {"id", "kind"}),
    ("regex", REGEX, lambda t: re.fullmatch(REGEX, t)),
    ("ebnf_grammar", 'root ::= "yes" | "no" | "maybe"', lambda t: t in ("yes", "no", "maybe")),
    ("json", None, lambda t: isinstance(json.loads(t, strict=False), dict)),
])
def test_tensorrt_llm_guided_decoding_tensors(server, guide_type, guide, check):
    extra = {"guided_decoding_guide_type": _text(guide_type), "max_tokens": (np.array([48], np.int32), "INT32"),
             "temperature": (np.array([0.0], np.float32), "FP32"),
             "return_finish_reason": (np.array([True]), "BOOL")}
    if guide is not None:
        extra["guided_decoding_guide"] = _text(guide)
    text, err, got = grpc_call(server, grpc_inputs("x = ", None, stream=True, **extra), outputs=["finish_reason"])
    assert err is None, err
    if got.get("finish_reason") == "stop" or guide_type != "json":  # greedy any-JSON may run to max_tokens
        assert check(text), text


@pytest.mark.parametrize("payload, message", [
    ({"sampling_parameters": json.dumps({"structured_outputs": {"regex": "a(b"}})},
     "structured_outputs.regex: invalid regex"),
    ({"sampling_parameters": json.dumps({"guided_decoding": {"json": {"type": "nope"}}})},
     "structured_outputs.json:"),
    ({"sampling_parameters": json.dumps({"guided_decoding": {"regex": "a", "backend": "outlines"}})},
     "backend: must be one of auto, guidance, xgrammar"),
    ({"guided_decoding_guide_type": "structural_tag", "guided_decoding_guide": "{}"},
     "guided_decoding_guide_type: expected one of"),
    ({"guided_decoding_guide_type": "regex"}, "guided_decoding_guide: is required"),
])
def test_invalid_specs_are_invalid_arg(server, payload, message):
    status, body = post(server, "generate", {"text_input": "x", **payload})
    assert status == 400 and message in json.loads(body)["error"], body
    assert post(server, "generate", {"text_input": "x", "max_tokens": 2})[0] == 200  # and it goes on
