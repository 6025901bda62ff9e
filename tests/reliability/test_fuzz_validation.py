"""Property-based fuzzing (hypothesis) of everything a request passes through before the engine: the Triton
request parser, SamplingParams and the InputProcessor. Whatever comes in, the outcome is a valid request or a
clear validation error (ValueError, one line, naming a field): never any other exception."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.config import RequestLimits
from pagedllm.sampling_params import SamplingParams
from pagedllm.serving.request_parser import KNOWN_INPUTS, InvalidRequest, ParsedRequest, parse_request

FIELDS = ["n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "max_tokens",
          "min_tokens", "ignore_eos", "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "skip_special_tokens", "best_of", "detokenize", "include_stop_str_in_output", "logit_bias",
          "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "prompt_logprobs"]
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2 ** 70, max_value=2 ** 70),
    st.integers(min_value=-3, max_value=300), st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20), st.sampled_from(["128", "0.7", "true", "false", "-1", "1e400", "NaN", "", "1e3"]))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=8), inner, max_size=4), max_leaves=12)
sampling_dicts = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=10), json_values, max_size=6)


def _raw_json(obj) -> str:
    return json.dumps(obj, allow_nan=True)


def _tensor(draw, name):
    """A numpy array of some dtype and shape for input `name`: mostly plausible, often not."""
    kind = draw(st.sampled_from(["bytes", "int32", "uint64", "float32", "bool", "empty", "two"]))
    if kind == "bytes":
        if name == "sampling_parameters" and draw(st.booleans()):
            data = _raw_json(draw(sampling_dicts)).encode()
        else:
            data = draw(st.binary(max_size=40) | st.text(max_size=40).map(str.encode))
        return np.array([data], dtype=np.object_)
    if kind == "int32":
        return np.array([draw(st.integers(min_value=-2 ** 31, max_value=2 ** 31 - 1))], dtype=np.int32)
    if kind == "uint64":
        return np.array([draw(st.integers(min_value=0, max_value=2 ** 64 - 1))], dtype=np.uint64)
    if kind == "float32":
        return np.array([draw(st.floats(width=32, allow_nan=True, allow_infinity=True))], dtype=np.float32)
    if kind == "bool":
        return np.array([draw(st.booleans())])
    if kind == "empty":
        return np.array([], dtype=np.int32)
    return np.array([1, 2], dtype=np.int32)


@st.composite
def triton_requests(draw):
    names = draw(st.lists(st.sampled_from(sorted(KNOWN_INPUTS)) | st.text(max_size=8), max_size=8, unique=True))
    if draw(st.booleans()):
        names.append("text_input")
    inputs = {name: _tensor(draw, name) for name in names}
    parameters = draw(st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), scalars, max_size=4))
    return inputs, parameters


def _clear(e: ValueError) -> None:
    msg = str(e)
    assert msg and "\n" not in msg and len(msg) < 400, msg
    assert ":" in msg  # "<field>: <what is wrong>"


@SETTINGS
@given(triton_requests())
def test_the_request_parser_returns_a_request_or_a_clear_error(req):
    inputs, parameters = req
    try:
        parsed = parse_request(inputs, parameters, RequestLimits(max_json_depth=4, max_json_bytes=200))
    except InvalidRequest as e:
        _clear(e)
        return
    assert isinstance(parsed, ParsedRequest) and isinstance(parsed.params, SamplingParams)
    assert parsed.prompt


@SETTINGS
@given(st.dictionaries(st.sampled_from(FIELDS[:16] + FIELDS[17:]), json_values, max_size=6))
def test_sampling_params_are_valid_or_refused_with_a_clear_error(kwargs):
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:
        _clear(e)
        return
    assert params.max_tokens is None or 1 <= params.max_tokens < 2 ** 31
    assert params.seed is None or 0 <= params.seed < 2 ** 64


@pytest.fixture(scope="module")
def processor(llama_dir):
    from transformers import AutoTokenizer

    from pagedllm.config import EngineConfig
    from pagedllm.engine.input_processor import InputProcessor
    from pagedllm.engine.model_info import ModelInfo

    config = EngineConfig.from_kwargs(llama_dir, max_model_len=64)
    tok = AutoTokenizer.from_pretrained(llama_dir)
    return InputProcessor(tok, ModelInfo.resolve(config, tok), config.limits)


prompts = st.one_of(st.text(max_size=60), st.lists(st.integers(min_value=-5, max_value=5000), max_size=80),
                    st.dictionaries(st.sampled_from(["prompt", "prompt_token_ids", "x"]), json_values, max_size=2),
                    json_values)


@SETTINGS
@given(prompt=prompts, stop_ids=st.lists(st.integers(min_value=-2, max_value=5000), max_size=4),
       logprobs=st.none() | st.integers(min_value=0, max_value=40), priority=scalars, timeout=scalars)
def test_the_input_processor_returns_a_request_or_a_clear_error(processor, prompt, stop_ids, logprobs, priority,
                                                                timeout):
    try:
        params = SamplingParams(stop_token_ids=stop_ids, logprobs=logprobs)
        req = processor.process(prompt, params, priority, timeout)
    except ValueError as e:
        _clear(e)
        return
    vocab = processor.info.vocab_size
    assert req.prompt_token_ids and all(0 <= t < vocab for t in req.prompt_token_ids)
    assert len(req.prompt_token_ids) < processor.info.max_model_len
    assert all(0 <= t < vocab for t in req.params.stop_token_ids)
