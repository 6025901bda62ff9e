"""Issue #18: a parameter that is accepted and ignored is a bug. Every documented input of both contracts is
walked here, vllm_backend's (every `sampling_parameters` key of vLLM 0.8-0.10's SamplingParams and 0.11's
stream_interval, and its tensors) and TensorRT-LLM's ensemble / tensorrt_llm_bls inputs: each either has a
visible effect (an output that differs from the default's in the expected way, through the request parser, the
InputProcessor, the engine on the tiny model and the ResponseBuilder) or is refused with an InvalidRequest naming
it.

The lists are written out (not derived from the parser) so that a key the parser starts accepting without a
check here fails `test_every_documented_input_has_a_check`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import RequestOutputKind
from pagedllm.serving.request_parser import InvalidRequest, parse_request
from pagedllm.serving.response_builder import ResponseBuilder

PROMPT = "def fibonacci(n):\n"
BASE = {"temperature": 0, "max_tokens": 16, "ignore_eos": True}
SAMPLED = {"temperature": 1.5, "seed": 1}
EOS = 1  # the tiny tokenizer's </s>

# vLLM 0.8-0.10 SamplingParams fields, as sampling_parameters keys.
VLLM_KEYS = [
    "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k",
    "min_p", "seed", "stop", "stop_token_ids", "bad_words", "include_stop_str_in_output", "ignore_eos",
    "max_tokens", "min_tokens", "logprobs", "prompt_logprobs", "detokenize", "skip_special_tokens",
    "spaces_between_special_tokens", "logits_processors", "truncate_prompt_tokens", "guided_decoding",
    "structured_outputs", "logit_bias", "allowed_token_ids", "extra_args", "output_kind", "stream_interval",
]
# vllm_backend's own sampling_parameters keys (read beside SamplingParams').
VLLM_BACKEND_KEYS = ["lora_name"]
# LoRA: checked against an engine serving one declared adapter (lora_llm below).
LORA = {"lora_name", "lora_task_id"}
# vllm_backend's tensors.
VLLM_TENSORS = [
    "text_input", "stream", "exclude_input_in_output", "return_finish_reason", "return_cumulative_logprob",
    "return_logprobs", "return_num_input_tokens", "return_num_output_tokens",
]
# TensorRT-LLM's ensemble and tensorrt_llm_bls inputs (and the tensorrt_llm model's runtime_top_k / _p).
TRTLLM_TENSORS = [
    "text_input", "decoder_text_input", "image_input", "image_bytes_input", "image_url_input", "video_bytes_input",
    "max_tokens", "bad_words", "stop_words", "exclude_input_in_output", "end_id", "pad_id", "top_k", "top_p",
    "runtime_top_k", "runtime_top_p", "temperature", "length_penalty", "repetition_penalty", "min_length",
    "min_tokens", "presence_penalty", "frequency_penalty", "random_seed", "seed", "return_log_probs",
    "return_context_logits", "return_generation_logits", "return_perf_metrics", "return_kv_cache_reuse_stats",
    "beam_width", "stream", "prompt_embedding_table", "prompt_vocab_size", "prompt_table_extra_id",
    "embedding_bias_words", "embedding_bias_weights", "num_draft_tokens", "use_draft_logits", "lora_task_id",
    "lora_weights", "lora_config", "guided_decoding_guide_type", "guided_decoding_guide", "num_return_sequences",
    "early_stopping",
]
# Structured output: checked in tests/serving/test_structured_output_served.py and tests/engine (another change
# adds their coverage checks here).
STRUCTURED = {"guided_decoding", "structured_outputs", "guided_decoding_guide_type", "guided_decoding_guide"}


def t(value, dtype=None):
    if isinstance(value, str):
        return np.array([value.encode()], dtype=np.object_)
    if isinstance(value, list):
        return np.array([v.encode() for v in value], dtype=np.object_)
    return np.array([value], dtype=dtype)


@dataclass
class Served:
    parsed: object
    final: object  # the last RequestOutput
    responses: list  # the arrays of every response

    @property
    def tokens(self):
        return self.final.outputs[0].token_ids

    @property
    def text(self):
        return "".join(r["text_output"][0].decode() for r in self.responses)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 24)


def serve(llm, inputs: dict) -> Served:
    """One request as the Triton adapter runs it, without Triton: parse, process, run, build responses."""
    parsed = parse_request(inputs)
    ip = llm.engine.input_processor
    if parsed.pad_id is not None:
        ip.check_token_ids("pad_id", [parsed.pad_id])
    processed = ip.process(parsed.prompt, parsed.params, parsed.priority, parsed.timeout, parsed.lora)
    llm.engine.add_request(processed)
    builder = ResponseBuilder(parsed, len(processed.prompt_token_ids))
    responses, final = [], None
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            responses.append(builder.arrays_for(out))
            final = out
    return Served(parsed, final, responses)


def sp(prompt=PROMPT, **params) -> dict:
    return {"text_input": t(prompt), "sampling_parameters": t(json.dumps({**BASE, **params}))}


def refused(llm, inputs: dict, name: str) -> None:
    with pytest.raises(ValueError) as e:  # InvalidRequest (parser) or ValueError (InputProcessor)
        serve(llm, inputs)
    assert name in str(e.value), str(e.value)


def tensors(extra: dict, **params) -> dict:
    return {**sp(**params), **extra}


# --- vLLM sampling_parameters keys -------------------------------------------------------------------------
def check_key(llm, key: str) -> None:
    base = serve(llm, sp())
    toks, text = base.tokens, base.final.outputs[0].text
    greedy_sampled_differs = serve(llm, sp(**SAMPLED)).tokens != toks
    if key == "n":  # n samples, sample i seeded seed + i, in one response's per-sequence outputs
        out = serve(llm, sp(**SAMPLED, n=3))
        assert [c.token_ids for c in out.final.outputs][0] == serve(llm, sp(**SAMPLED)).tokens
        assert list(out.responses[-1]["sequence_index"]) == [0, 1, 2] and len(out.responses[-1]["text_output"]) == 3
        assert len({tuple(c.token_ids) for c in out.final.outputs}) == 3
    elif key == "best_of":  # the n best of best_of by cumulative logprob
        out = serve(llm, sp(**SAMPLED, n=1, best_of=4))
        every = serve(llm, sp(**SAMPLED, n=4, logprobs=0)).final.outputs
        assert out.tokens == max(every, key=lambda c: c.cumulative_logprob).token_ids
        refused(llm, sp(n=3, best_of=2), key)
    elif key in ("presence_penalty", "frequency_penalty"):
        assert serve(llm, sp(**{key: 2.0})).tokens != toks
    elif key == "repetition_penalty":
        assert serve(llm, sp(repetition_penalty=3.0)).tokens != toks
    elif key == "temperature":
        assert greedy_sampled_differs
    elif key in ("top_p", "top_k", "min_p"):  # the narrowest setting of each makes sampling greedy
        assert greedy_sampled_differs
        assert serve(llm, sp(**SAMPLED, **{key: {"top_p": 1e-6, "top_k": 1, "min_p": 1.0}[key]})).tokens == toks
    elif key == "seed":
        one = serve(llm, sp(**SAMPLED)).tokens
        assert serve(llm, sp(**{**SAMPLED, "seed": 2})).tokens != one and serve(llm, sp(**SAMPLED)).tokens == one
    elif key in ("stop", "include_stop_str_in_output"):
        stop = text[4:7]
        cut = text[:text.index(stop)]
        out = serve(llm, sp(stop=[stop], include_stop_str_in_output=key == "include_stop_str_in_output"))
        assert out.final.outputs[0].text == (cut + stop if key != "stop" else cut)
        assert out.final.outputs[0].finish_reason == "stop"
    elif key == "stop_token_ids":
        stop = toks[3]
        out = serve(llm, sp(stop_token_ids=[stop]))
        assert out.final.outputs[0].stop_reason == stop and len(out.tokens) <= toks.index(stop) + 1
    elif key == "bad_words":
        word = llm.get_tokenizer().decode(toks[2:4]).strip()
        assert word and serve(llm, sp(bad_words=[word])).tokens != toks
    elif key == "ignore_eos":  # EOS pushed to the top: it ends the output unless ignored
        assert serve(llm, sp(logit_bias={EOS: 100}, ignore_eos=False)).final.outputs[0].finish_reason == "stop"
        assert serve(llm, sp(logit_bias={EOS: 100}, ignore_eos=True)).tokens == [EOS] * 16
    elif key == "max_tokens":
        out = serve(llm, sp(max_tokens=3))
        assert out.tokens == toks[:3] and out.final.outputs[0].finish_reason == "length"
    elif key == "min_tokens":
        out = serve(llm, sp(logit_bias={EOS: 100}, ignore_eos=False, min_tokens=5))
        assert len(out.tokens) == 6 and out.final.outputs[0].finish_reason == "stop"
    elif key == "logprobs":
        out = serve(llm, sp(logprobs=2)).final.outputs[0]
        assert base.final.outputs[0].logprobs is None
        assert len(out.logprobs) == 16 and all(2 <= len(e) <= 3 for e in out.logprobs)
    elif key == "prompt_logprobs":
        out = serve(llm, sp(prompt_logprobs=1)).final
        assert base.final.prompt_logprobs is None
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None
    elif key == "detokenize":
        out = serve(llm, sp(detokenize=False))
        assert out.final.outputs[0].text == "" and out.tokens == toks
    elif key == "skip_special_tokens":
        pushed = {"logit_bias": {EOS: 100}, "max_tokens": 2}
        assert serve(llm, sp(**pushed)).final.outputs[0].text == ""
        assert "</s>" in serve(llm, sp(**pushed, skip_special_tokens=False)).final.outputs[0].text
    elif key == "spaces_between_special_tokens":
        refused(llm, sp(spaces_between_special_tokens=False), key)
    elif key in ("logits_processors", "extra_args", "output_kind"):  # not expressible over the wire here
        refused(llm, sp(**{key: {"logits_processors": ["f"], "extra_args": {"a": 1}, "output_kind": 1}[key]}), key)
    elif key == "truncate_prompt_tokens":
        out = serve(llm, sp(truncate_prompt_tokens=3))
        assert out.final.prompt_token_ids == base.final.prompt_token_ids[-3:]
    elif key == "logit_bias":
        assert serve(llm, sp(logit_bias={"77": 100})).tokens == [77] * 16
    elif key == "stream_interval":  # a stream's responses: the first token, then every 4, then the last
        every_token = serve(llm, tensors({"stream": t(True)}, detokenize=False))
        spaced = serve(llm, tensors({"stream": t(True)}, detokenize=False, stream_interval=4))
        assert len(every_token.responses) == 16 and len(spaced.responses) == 5  # tokens 1, 5, 9, 13, 16
        assert serve(llm, tensors({"stream": t(True)}, stream_interval=4)).text == text
        refused(llm, sp(stream_interval=0), key)
    elif key == "allowed_token_ids":
        out = serve(llm, sp(**SAMPLED, allowed_token_ids=[10, 20]))
        assert set(out.tokens) <= {10, 20} and out.tokens != toks
    else:
        raise AssertionError(f"no check for sampling_parameters key {key!r}")


# --- tensors --------------------------------------------------------------------------------------------
# A TensorRT-LLM scalar tensor does what its sampling_parameters key does: (value, dtype, equivalent params,
# params the comparison runs under).
EQUIVALENT = {
    "max_tokens": (3, np.int32, {"max_tokens": 3}, {}),
    "temperature": (1.5, np.float32, {"temperature": 1.5}, {"seed": 1}),
    "top_k": (1, np.int32, {"top_k": 1}, SAMPLED),
    "runtime_top_k": (1, np.int32, {"top_k": 1}, SAMPLED),
    "top_p": (1e-6, np.float32, {"top_p": 1e-6}, SAMPLED),
    "runtime_top_p": (1e-6, np.float32, {"top_p": 1e-6}, SAMPLED),
    "repetition_penalty": (3.0, np.float32, {"repetition_penalty": 3.0}, {}),
    "presence_penalty": (2.0, np.float32, {"presence_penalty": 2.0}, {}),
    "frequency_penalty": (2.0, np.float32, {"frequency_penalty": 2.0}, {}),
    "random_seed": (2, np.uint64, {"seed": 2}, {"temperature": 1.5}),
    "seed": (2, np.uint64, {"seed": 2}, {"temperature": 1.5}),
    "min_length": (5, np.int32, {"min_tokens": 5}, {"logit_bias": {EOS: 100}, "ignore_eos": False}),
    "min_tokens": (5, np.int32, {"min_tokens": 5}, {"logit_bias": {EOS: 100}, "ignore_eos": False}),
}
UNKNOWN_TRTLLM = {
    "decoder_text_input": t("x"), "image_input": np.zeros((1, 3, 2, 2), np.float16), "image_bytes_input": t("x"),
    "image_url_input": t("x"), "video_bytes_input": t("x"),
    "return_kv_cache_reuse_stats": t(True), "prompt_embedding_table": np.zeros((1, 4, 8), np.float16),
    "prompt_vocab_size": t(4, np.int32), "prompt_table_extra_id": t(1, np.uint64),
    "embedding_bias_words": t(["x"]), "embedding_bias_weights": np.array([1.0], np.float32),
    "num_draft_tokens": t(2, np.int32), "use_draft_logits": t(True),
    "lora_weights": np.zeros((1, 8), np.float16), "lora_config": np.zeros((1, 3), np.int32),
}


def check_tensor(llm, name: str) -> None:
    base = serve(llm, sp())
    toks, text = base.tokens, base.final.outputs[0].text
    if name in EQUIVALENT:
        value, dtype, params, under = EQUIVALENT[name]
        via_tensor = serve(llm, tensors({name: t(value, dtype)}, **under)).tokens
        assert via_tensor == serve(llm, sp(**under, **params)).tokens != serve(llm, sp(**under)).tokens
    elif name in UNKNOWN_TRTLLM:
        refused(llm, tensors({name: UNKNOWN_TRTLLM[name]}), name)
    elif name == "text_input":
        assert serve(llm, sp(prompt="class Stack:\n")).tokens != toks
    elif name == "stream":
        out = serve(llm, tensors({"stream": t(True)}))
        assert out.parsed.params.output_kind == RequestOutputKind.DELTA and len(out.responses) > 1
        assert out.text == text  # deltas, without the prompt, join to the whole text
    elif name == "exclude_input_in_output":
        assert base.text == PROMPT + text
        assert serve(llm, tensors({name: t(True)})).text == text
    elif name.startswith("return_") and name in VLLM_TENSORS:
        key = name[len("return_"):]
        # logprobs come back when sampling_parameters asks for them (vllm_backend's); null otherwise
        out = serve(llm, tensors({name: t(True)}, **({"logprobs": 1} if key == "logprobs" else {})))
        assert key not in base.responses[-1] and key in out.responses[-1]
        value = out.responses[-1][key]
        expected = {"finish_reason": b"length", "num_input_tokens": len(out.final.prompt_token_ids),
                    "num_output_tokens": 16}
        if key in expected:
            assert value[0] == expected[key]
        elif key == "logprobs":
            assert len(json.loads(value[0])) == 16
        else:
            assert value[0] < 0
    elif name == "bad_words":
        word = llm.get_tokenizer().decode(toks[2:4]).strip()
        assert serve(llm, tensors({name: t([word])})).tokens == serve(llm, sp(bad_words=[word])).tokens != toks
    elif name == "stop_words":
        stop = text[4:7]
        assert serve(llm, tensors({name: t([stop])})).final.outputs[0].text == text[:text.index(stop)]
    elif name == "end_id":
        out = serve(llm, tensors({name: t(toks[3], np.int32)}))
        assert out.final.outputs[0].stop_reason == toks[3]
    elif name == "pad_id":
        # Checked against the vocabulary; nothing else to do: outputs are one request's text, never padded.
        assert serve(llm, tensors({name: t(2, np.int32)})).tokens == toks
        refused(llm, tensors({name: t(99999, np.int32)}), name)
    elif name == "return_log_probs":
        last = serve(llm, tensors({name: t(True)})).responses[-1]
        assert last["output_log_probs"].shape == (1, 16) and last["cum_log_probs"][0] == pytest.approx(
            float(last["output_log_probs"].sum()), abs=1e-3)
    elif name == "return_perf_metrics":
        last = serve(llm, tensors({name: t(True)})).responses[-1]
        assert "kv_cache_reused_blocks" not in base.responses[-1]
        assert last["kv_cache_alloc_total_blocks"][0] >= 1 and last["arrival_time_ns"][0] > 0
    elif name in ("return_context_logits", "return_generation_logits"):
        assert serve(llm, tensors({name: t(False)})).tokens == toks  # the default is accepted
        refused(llm, tensors({name: t(True)}), name)
    elif name == "num_return_sequences":  # samples, or the best beams returned
        assert serve(llm, tensors({name: t(1, np.int32)})).tokens == toks
        two = serve(llm, tensors({name: t(2, np.int32)}, **SAMPLED)).final.outputs
        assert len(two) == 2 and two[0].token_ids != two[1].token_ids
        beams = serve(llm, tensors({name: t(2, np.int32), "beam_width": t(4, np.int32)})).final.outputs
        assert [c.token_ids for c in beams] == [c.token_ids for c in beam_search(llm, 4)[:2]]
    elif name == "beam_width":  # every beam returned, best first, as LLM.beam_search gives them
        out = serve(llm, tensors({name: t(3, np.int32), "return_log_probs": t(True)}))
        assert [c.token_ids for c in out.final.outputs] == [c.token_ids for c in beam_search(llm, 3)]
        assert out.responses[-1]["cum_log_probs"].shape == (3,) and out.responses[-1]["output_log_probs"].shape[0] == 3
        assert serve(llm, tensors({name: t(1, np.int32)})).tokens == toks
        refused(llm, tensors({name: t(2, np.int32)}, temperature=0.7), "temperature")
    elif name in ("length_penalty", "early_stopping"):
        # A stop token the beams meet early (end_id) makes hypotheses of different lengths, which the penalty
        # ranks: a negative one keeps the shortest, a large one the longest. The oracle tests check both rules.
        end = {"end_id": t(beam_search(llm, 4)[1].token_ids[1], np.int32), "beam_width": t(4, np.int32)}
        short = serve(llm, tensors({"length_penalty": t(-2.0, np.float32), **end})).final.outputs
        long = serve(llm, tensors({"length_penalty": t(3.0, np.float32), **end})).final.outputs
        assert len(short[0].token_ids) < len(long[0].token_ids) == 16 and short[0].finish_reason == "stop"
        early = serve(llm, tensors({"early_stopping": t(True), **end}))
        assert early.parsed.params.early_stopping is True
        stop = int(end["end_id"][0])
        offline = llm.generate(PROMPT, SamplingParams(beam_width=4, n=4, temperature=0, max_tokens=16,
                                                      early_stopping=True, stop_token_ids=[stop], ignore_eos=True),
                               use_tqdm=False)[0].outputs
        assert [c.token_ids for c in early.final.outputs] == [c.token_ids for c in offline]
    else:
        raise AssertionError(f"no check for input tensor {name!r}")


def beam_search(llm, width, eos=False, **kw):
    from pagedllm import BeamSearchParams

    params = BeamSearchParams(beam_width=width, max_tokens=16, ignore_eos=not eos, **kw)
    return llm.beam_search(PROMPT, params)[0].outputs


def test_every_documented_input_has_a_check():
    checked = set(VLLM_KEYS) | set(VLLM_BACKEND_KEYS) | set(VLLM_TENSORS) | set(TRTLLM_TENSORS)
    assert STRUCTURED <= checked and LORA <= checked
    assert set(EQUIVALENT) | set(UNKNOWN_TRTLLM) <= checked


def check_structured(llm, name: str) -> None:
    """Structured output in both contracts: the output follows the regex (ignore_eos is refused with it)."""
    regex = "[a-c]{3}-[0-9]"
    plain = {"temperature": 0, "max_tokens": 16, "ignore_eos": False}
    if name in ("guided_decoding", "structured_outputs"):
        inputs = {"text_input": t(PROMPT), "sampling_parameters": t(json.dumps({**plain, name: {"regex": regex}}))}
    elif name == "guided_decoding_guide_type":
        inputs = {"text_input": t(PROMPT), "sampling_parameters": t(json.dumps(plain)),
                  "guided_decoding_guide_type": t("regex"), "guided_decoding_guide": t(regex)}
    else:  # the guide alone says nothing about how to read it
        refused(llm, {"text_input": t(PROMPT), "guided_decoding_guide": t(regex)}, "guided_decoding_guide")
        return
    out = serve(llm, inputs).final.outputs[0]
    assert re.fullmatch(regex, out.text) and out.finish_reason == "stop", out


@pytest.fixture(scope="module")
def lora_llm(llama_dir, tmp_path_factory):
    from pagedllm.tiny_model import make_lora_adapter

    path = make_lora_adapter(llama_dir, str(tmp_path_factory.mktemp("adapter")), rank=8, seed=3)
    return LLM(llama_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 24, enable_lora=True,
               lora_modules={"coder": path})


def check_lora(lora_llm, name: str) -> None:
    """The adapter named by lora_name (sampling_parameters) or lora_task_id (its id, 1) changes the tokens the
    same way; an unknown one is refused, naming the field; an engine without LoRA refuses both."""
    base = serve(lora_llm, sp()).tokens
    via_name = serve(lora_llm, sp(lora_name="coder")).tokens
    assert via_name != base
    if name == "lora_name":
        refused(lora_llm, sp(lora_name="other"), "lora_name")
    else:
        assert serve(lora_llm, tensors({name: t(1, np.uint64)})).tokens == via_name
        refused(lora_llm, tensors({name: t(2, np.uint64)}), name)
        refused(lora_llm, tensors({name: t(1, np.uint64)}, lora_name="coder"), name)


@pytest.mark.parametrize("key", VLLM_KEYS + VLLM_BACKEND_KEYS)
def test_sampling_parameters_key(llm, lora_llm, key):
    if key in LORA:
        check_lora(lora_llm, key)
        refused(llm, sp(lora_name="coder"), key)
        return
    (check_structured if key in STRUCTURED else check_key)(llm, key)


@pytest.mark.parametrize("name", sorted(set(VLLM_TENSORS) | set(TRTLLM_TENSORS)))
def test_input_tensor(llm, lora_llm, name):
    if name in LORA:
        check_lora(lora_llm, name)
        refused(llm, tensors({name: t(1, np.uint64)}), name)
        return
    (check_structured if name in STRUCTURED else check_tensor)(llm, name)


def test_refusals_are_invalid_requests():
    """The parser's refusals are InvalidRequest (INVALID_ARG through Triton), naming the input."""
    for inputs, name in ((sp(n=0), "n"), (tensors({"beam_width": t(0, np.int32)}), "beam_width"),
                         (tensors({"lora_weights": np.zeros((1, 8), np.float16)}), "lora_weights")):
        with pytest.raises(InvalidRequest, match=name):
            parse_request(inputs)
