"""An OpenAI request's fields → the model's `sampling_parameters` JSON object (vllm_backend's keys).

Only fields the caller set are sent, so the engine's defaults apply otherwise (temperature 1 and top_p 1, as
OpenAI's), with one exception: `max_tokens` of a completion defaults to 16, OpenAI's (and vLLM's) documented
default for /v1/completions; a chat completion runs until a stop condition or the context is full, as OpenAI's.
"""

from __future__ import annotations

from pagedllm.openai.protocol import ChatCompletionRequest, CompletionRequest, RequestBase

COMPLETION_DEFAULT_MAX_TOKENS = 16

# Request fields passed through under the same name.
_PASSED = ("temperature", "top_p", "seed", "stop", "presence_penalty", "frequency_penalty", "top_k", "min_p",
           "repetition_penalty", "min_tokens", "ignore_eos", "skip_special_tokens", "logit_bias",
           "allowed_token_ids", "bad_words", "include_stop_str_in_output", "truncate_prompt_tokens", "n",
           "stream_interval")


def _common(req: RequestBase) -> dict:
    out = {k: getattr(req, k) for k in _PASSED if getattr(req, k) is not None}
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        out["structured_outputs"] = {"json_object": True}
    elif fmt is not None and fmt.type == "json_schema":  # no schema given: any JSON object, as OpenAI's
        schema = fmt.json_schema.schema_
        out["structured_outputs"] = {"json": schema} if schema is not None else {"json_object": True}
    return out


def completion_sampling(req: CompletionRequest) -> dict:
    out = _common(req)
    out["max_tokens"] = req.max_tokens if req.max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
    if req.logprobs is not None:
        out["logprobs"] = req.logprobs  # the sampled token's plus the top-k alternatives'
    if req.best_of is not None:
        out["best_of"] = req.best_of
    return out


def chat_sampling(req: ChatCompletionRequest) -> dict:
    out = _common(req)
    # max_completion_tokens replaces the deprecated max_tokens in OpenAI's chat API; it wins when both are set.
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if limit is not None:
        out["max_tokens"] = limit
    if req.logprobs:
        out["logprobs"] = req.top_logprobs or 0
    return out


# The model's error messages name its own keys: the request field each came from, per endpoint.
COMPLETION_PARAMS = {"text_input": "prompt", "structured_outputs": "response_format"}
CHAT_PARAMS = {"text_input": "messages", "logprobs": "top_logprobs", "structured_outputs": "response_format"}
