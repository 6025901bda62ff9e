"""Turns one Triton request's input tensors into engine arguments.

Accepts both anchors' tensor contracts so existing tools work unchanged:
- vllm_backend: text_input, stream, sampling_parameters (JSON; numbers may arrive as strings, as genai-perf
  sends them), exclude_input_in_output, return_* flags;
- chat: `messages` (an OpenAI-format conversation as JSON) instead of text_input, rendered by the engine's
  chat template; the output never repeats the prompt;
- TensorRT-LLM ensemble: max_tokens, temperature, top_k/runtime_top_k, top_p/runtime_top_p, seed/random_seed,
  stop_words, bad_words, min_tokens/min_length, penalties, end_id, pad_id, return_log_probs (cum_log_probs,
  output_log_probs), return_perf_metrics (KV reuse and timing outputs), beam_width with length_penalty and
  early_stopping (beam search), num_return_sequences (samples, or the best beams returned),
  guided_decoding_guide_type + guided_decoding_guide (structured output; `structured_outputs` /
  `guided_decoding` in sampling_parameters is vllm_backend's way: serving/structured_inputs.py);
  lora_task_id names a declared adapter by its id (vllm_backend's way: `lora_name` in sampling_parameters);
  lora_weights / lora_config (an adapter's weights sent with a request) are refused: adapters are declared
  where the server starts (engine.json's lora_modules, or multi_lora.json);
  pad_id is checked against the vocabulary and otherwise has nothing to do: TensorRT-LLM pads output_ids of
  a batch to one length, but every response here carries one request's own tokens (text), never padded;
- ours: priority, timeout (seconds).
Pure Python over numpy arrays (no Triton import), so it is unit-testable. Every problem (a wrong type or shape,
non-UTF-8 bytes, JSON that is broken, too large or too deep, a number out of range) raises InvalidRequest with a
one-line message naming the input; with several problems, the first. Ranges the vocabulary and the server's
limits decide are checked next, by the engine's InputProcessor.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from pagedllm.config import RequestLimits
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.serving import structured_inputs


class InvalidRequest(ValueError):
    pass


@dataclass
class ParsedRequest:
    prompt: str  # "" for a chat request
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = False
    priority: int = 0
    timeout: float | None = None
    returns: set[str] = field(default_factory=set)  # which optional outputs to send
    pad_id: int | None = None  # TensorRT-LLM's; checked against the vocabulary (outputs are never padded)
    messages: list | None = None  # a chat request's conversation (checked in full by the chat template)
    lora: str | int | None = None  # the adapter: its name (lora_name) or id (lora_task_id)
    # Request parameter `heartbeat`: an empty response after each HEARTBEAT_S without one (triton_model.py).
    heartbeat: bool = False


# sampling_parameters JSON keys -> (SamplingParams field, type)
_JSON_PARAMS = {
    "temperature": float, "top_p": float, "top_k": int, "min_p": float, "seed": int, "max_tokens": int,
    "min_tokens": int, "ignore_eos": bool, "logprobs": int, "presence_penalty": float,
    "frequency_penalty": float, "repetition_penalty": float, "skip_special_tokens": bool, "n": int,
    "include_stop_str_in_output": bool, "truncate_prompt_tokens": int, "detokenize": bool, "prompt_logprobs": int,
    "best_of": int, "stream_interval": int,
}
_JSON_LIST_PARAMS = {"stop": str, "stop_token_ids": int, "allowed_token_ids": int, "bad_words": str}
_NULLABLE = {"seed", "max_tokens", "logprobs", "truncate_prompt_tokens", "prompt_logprobs", "best_of",
             "stream_interval"}
# Keys vLLM accepts whose only value here is vLLM's default (so a client written for vllm_backend that sends
# them keeps working); any other value is refused rather than silently ignored.
_JSON_DEFAULT_ONLY = {"spaces_between_special_tokens": (True,)}

# TensorRT-LLM-style scalar inputs -> SamplingParams field
_TENSOR_PARAMS = {
    "max_tokens": "max_tokens", "temperature": "temperature", "top_k": "top_k", "runtime_top_k": "top_k",
    "top_p": "top_p", "runtime_top_p": "top_p", "seed": "seed", "random_seed": "seed",
    "min_tokens": "min_tokens", "min_length": "min_tokens", "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty", "repetition_penalty": "repetition_penalty",
    "beam_width": "beam_width", "length_penalty": "length_penalty",
}
_FLOAT_FIELDS = {"temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                 "length_penalty"}
_RETURN_FLAGS = {
    "return_finish_reason": "finish_reason", "return_cumulative_logprob": "cumulative_logprob",
    "return_logprobs": "logprobs", "return_num_input_tokens": "num_input_tokens",
    "return_num_output_tokens": "num_output_tokens", "return_log_probs": "cumulative_logprob",
    "return_perf_metrics": "perf_metrics",
}
# TensorRT-LLM inputs accepted at their default only (clients send them as such); any other value is refused.
_TENSOR_DEFAULT_ONLY = {"return_context_logits": (bool, False, "logits are not returned"),
                        "return_generation_logits": (bool, False, "logits are not returned")}
KNOWN_INPUTS = ({"text_input", "messages", "stream", "guided_decoding_guide_type", "guided_decoding_guide", "sampling_parameters", "exclude_input_in_output", "priority", "timeout",
                 "stop_words", "bad_words", "end_id", "pad_id", "ignore_eos", "early_stopping",
                 "num_return_sequences", "lora_task_id", "lora_weights", "lora_config"}
                | set(_TENSOR_PARAMS) | set(_RETURN_FLAGS) | set(_TENSOR_DEFAULT_ONLY))


def parse_request(inputs: dict[str, np.ndarray], parameters: dict | None = None,
                  limits: RequestLimits | None = None) -> ParsedRequest:
    """`parameters` are the request's Triton parameters (HTTP generate puts JSON keys that are not inputs
    there); they are read as sampling parameters, overridden by `sampling_parameters` and by tensors."""
    limits = limits or RequestLimits()
    unknown = set(inputs) - KNOWN_INPUTS
    if unknown:
        raise InvalidRequest(f"unknown input(s): {', '.join(_show(n) for n in sorted(unknown))[:200]}")
    if ("text_input" in inputs) == ("messages" in inputs):
        raise InvalidRequest("text_input or messages: exactly one is required")
    messages = None
    if "messages" in inputs:
        messages, prompt = _parse_messages(_text(inputs["messages"], "messages"), limits), ""
    else:
        prompt = _text(inputs["text_input"], "text_input")
        if not prompt:
            raise InvalidRequest("text_input: is empty")

    kwargs: dict = {}
    parameters = dict(parameters or {})
    heartbeat = parameters.pop("heartbeat", False)
    if not isinstance(heartbeat, bool):
        raise InvalidRequest(f"heartbeat: must be a boolean, got {_show(heartbeat)}")
    if parameters:
        kwargs.update(_parse_sampling_dict(parameters, "request parameters"))
    if "sampling_parameters" in inputs:
        kwargs.update(_parse_sampling_json(_text(inputs["sampling_parameters"], "sampling_parameters"), limits))
    lora = kwargs.pop("lora_name", None)
    for name in ("lora_weights", "lora_config"):
        if name in inputs:
            raise InvalidRequest(f"{name}: adapters are not sent with requests here; declare the adapter in "
                                 "engine.json's lora_modules or in multi_lora.json and name it by lora_task_id "
                                 "or lora_name")
    if "lora_task_id" in inputs:
        if lora is not None:
            raise InvalidRequest("lora_task_id: give either lora_task_id or lora_name, not both")
        lora = _scalar(inputs["lora_task_id"], "lora_task_id", int)
    for name, target in _TENSOR_PARAMS.items():
        if name in inputs:
            kwargs[target] = _scalar(inputs[name], name, float if target in _FLOAT_FIELDS else int)
    if "stop_words" in inputs:
        kwargs["stop"] = kwargs.get("stop", []) + _string_list(inputs["stop_words"], "stop_words")
    if "bad_words" in inputs:
        kwargs["bad_words"] = kwargs.get("bad_words", []) + _string_list(inputs["bad_words"], "bad_words")
    if "end_id" in inputs:
        kwargs["stop_token_ids"] = kwargs.get("stop_token_ids", []) + [_scalar(inputs["end_id"], "end_id", int)]
    if "guided_decoding_guide_type" in inputs:
        guide = _text(inputs["guided_decoding_guide"], "guided_decoding_guide") if "guided_decoding_guide" in inputs \
            else None
        try:
            kwargs["structured_outputs"] = structured_inputs.from_trtllm(
                _text(inputs["guided_decoding_guide_type"], "guided_decoding_guide_type"), guide)
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
    elif "guided_decoding_guide" in inputs:
        raise InvalidRequest("guided_decoding_guide: needs guided_decoding_guide_type")
    if "ignore_eos" in inputs:
        kwargs["ignore_eos"] = _flag(inputs, "ignore_eos")
    if "early_stopping" in inputs:
        kwargs["early_stopping"] = _flag(inputs, "early_stopping")
    # TensorRT-LLM's num_return_sequences: samples (n), or with beam search the best beams returned (all of
    # them when it is not given, as TensorRT-LLM returns beam_width beams).
    if "num_return_sequences" in inputs:
        kwargs["n"] = _scalar(inputs["num_return_sequences"], "num_return_sequences", int)
    elif kwargs.get("beam_width", 1) > 1 and "n" not in kwargs:
        kwargs["n"] = kwargs["beam_width"]
    for name, (kind, default, why) in _TENSOR_DEFAULT_ONLY.items():
        if name in inputs and (_flag(inputs, name) if kind is bool else _scalar(inputs[name], name, kind)) != default:
            raise InvalidRequest(f"{name}: {why}")
    returns = {out for flag, out in _RETURN_FLAGS.items() if _flag(inputs, flag)}
    if _flag(inputs, "return_log_probs"):  # TensorRT-LLM's outputs for it (and vllm_backend's cumulative_logprob)
        returns |= {"cum_log_probs", "output_log_probs"}
    if "cumulative_logprob" in returns and kwargs.get("logprobs") is None:
        kwargs["logprobs"] = 0  # logprobs are computed only when asked for: ask for the sampled token's
    stream = _flag(inputs, "stream")
    # A stream sends what is new at each step; otherwise one response carries the final result.
    kwargs["output_kind"] = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:
        raise InvalidRequest(str(e)) from None
    return ParsedRequest(
        prompt=prompt,
        params=params,
        stream=stream,
        exclude_input_in_output=_flag(inputs, "exclude_input_in_output") or messages is not None,
        priority=_scalar(inputs["priority"], "priority", int) if "priority" in inputs else 0,
        timeout=_scalar(inputs["timeout"], "timeout", float) if "timeout" in inputs else None,
        returns=returns,
        pad_id=_scalar(inputs["pad_id"], "pad_id", int) if "pad_id" in inputs else None,
        messages=messages,
        lora=lora,
        heartbeat=heartbeat,
    )


def _parse_sampling_json(raw: str, limits: RequestLimits) -> dict:
    obj = _load_json(raw, "sampling_parameters", limits.max_json_bytes, limits.max_json_depth)
    if not isinstance(obj, dict):
        raise InvalidRequest("sampling_parameters: must be a JSON object")
    return _parse_sampling_dict(obj, "sampling_parameters")


def _parse_messages(raw: str, limits: RequestLimits) -> list:
    # A conversation is prompt text: it is bounded by the prompt's byte limit, not the small JSON one.
    obj = _load_json(raw, "messages", limits.max_prompt_bytes, limits.max_json_depth)
    if not isinstance(obj, list) or not obj:
        raise InvalidRequest("messages: must be a non-empty JSON array of message objects")
    return obj


def _load_json(raw: str, name: str, max_bytes: int, max_depth: int):
    size = len(raw.encode("utf-8", errors="surrogatepass"))
    if size > max_bytes:
        raise InvalidRequest(f"{name}: {size} bytes of JSON, at most {max_bytes} allowed")
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"{name}: not valid JSON ({e.msg} at position {e.pos})") from None
    except RecursionError:
        raise InvalidRequest(f"{name}: JSON nested deeper than {max_depth} levels") from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise InvalidRequest(f"{name}: not valid JSON ({str(e).splitlines()[0][:120]})") from None
    if _depth(obj) > max_depth:
        raise InvalidRequest(f"{name}: JSON nested deeper than {max_depth} levels")
    return obj


def _depth(obj) -> int:
    """Nesting depth of JSON arrays and objects (a scalar is 0), without recursion."""
    deepest, stack = 0, [(obj, 1)]
    while stack:
        value, level = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest


def _parse_sampling_dict(obj: dict, where: str) -> dict:
    out: dict = {}
    for key, value in obj.items():
        name = f"{where}.{key}" if where != "request parameters" else str(key)
        if key in _JSON_DEFAULT_ONLY:
            allowed = _JSON_DEFAULT_ONLY[key]
            kind = type(allowed[-1])
            if value is not None or None not in allowed:
                if _coerce(value, kind, name) not in allowed:
                    raise InvalidRequest(f"{name}: only {allowed[-1]!r} is supported, got {_show(value)}")
        elif key in ("structured_outputs", "guided_decoding"):
            if value is not None:
                try:
                    out["structured_outputs"] = structured_inputs.from_vllm(value, name)
                except ValueError as e:
                    raise InvalidRequest(str(e)) from None
        elif key == "logit_bias":
            if value is not None:
                if not isinstance(value, dict):
                    raise InvalidRequest(f"{name}: expected an object mapping token ids to biases")
                out[key] = {_coerce(k, int, name): _coerce(v, float, name) for k, v in value.items()}
        elif key == "lora_name":
            if value is not None:
                if not isinstance(value, str) or not value:
                    raise InvalidRequest(f"{name}: expected an adapter's name, got {_show(value)}")
                out[key] = value
        elif key in _JSON_PARAMS:
            out[key] = None if value is None and key in _NULLABLE else _coerce(value, _JSON_PARAMS[key], name)
        elif key in _JSON_LIST_PARAMS:
            values = value if isinstance(value, list) else [value]
            out[key] = [_coerce(v, _JSON_LIST_PARAMS[key], name) for v in values]
        else:
            raise InvalidRequest(f"{where}: unknown parameter {_show(key)}")
    return out


def _coerce(value, kind: type, name: str):
    """Convert a JSON or tensor value, including numbers and booleans sent as strings ("128", "0.7", "true").
    Integers never pass through float: seeds keep all 64 bits."""
    bad = InvalidRequest(f"{name}: expected {'an integer' if kind is int else kind.__name__}, got {_show(value)}")
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise bad
    if kind is str:
        if not isinstance(value, str):
            raise bad
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise bad
    if kind is int:
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass  # "128.0" or "1e3": through float below, if it is a whole number
        try:
            f = float(value)
        except (ValueError, OverflowError):
            raise bad from None
        if not (math.isfinite(f) and f.is_integer()):
            raise bad
        return int(f)
    try:
        return float(value)
    except (ValueError, OverflowError):
        raise bad from None


def _show(value) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _first(arr: np.ndarray, name: str):
    a = np.asarray(arr)
    if a.size != 1:
        raise InvalidRequest(f"{name}: expected exactly one element, got shape {list(a.shape)}")
    return a.reshape(-1)[0]


def _text(arr: np.ndarray, name: str) -> str:
    v = _first(arr, name)
    if isinstance(v, (bytes, np.bytes_)):
        try:
            return bytes(v).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidRequest(f"{name}: is not valid UTF-8 (byte {e.start})") from None
    if isinstance(v, str):
        return v
    raise InvalidRequest(f"{name}: expected a string, got {type(v).__name__}")


def _scalar(arr: np.ndarray, name: str, kind: type):
    v = _first(arr, name)
    if isinstance(v, (bytes, np.bytes_, str)):
        raise InvalidRequest(f"{name}: expected a number, got a string")
    return _coerce(v.item() if hasattr(v, "item") else v, kind, name)


def _flag(inputs: dict, name: str) -> bool:
    if name not in inputs:
        return False
    v = _first(inputs[name], name)
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    raise InvalidRequest(f"{name}: expected a boolean")


def _string_list(arr: np.ndarray, name: str) -> list[str]:
    out = []
    for v in np.asarray(arr).reshape(-1):
        s = _text(np.array([v], dtype=object), name)
        if s:
            out.append(s)
    return out
