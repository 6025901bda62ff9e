"""Errors from Triton → OpenAIError (HTTP status, message, param).

From the generate endpoint an error carries only its message text (`{"error": "..."}`, as the body of a non-200
status before the first event or as an event after it), and Triton's status code is not to be relied on for
what the model meant. So the rule is read from the text, and it is built on what the pagedllm model sends:

- its non-validation messages are a closed, known set: UNAVAILABLE ones ("overloaded: ...", "engine is not
  running: ...", "engine failed: ...", "engine is restarting", "the model is being unloaded", "request
  aborted: ..."), plus Triton's own when the model is not loaded (unknown model, not ready, no available
  versions) → 503; INTERNAL ones ("request failed: ..." for a failure inside one request, "could not process
  the request: ...") → 500;
- everything else is a validation error (INVALID_ARG), an open set whose messages all start with the name of
  the offending input or field ("temperature: must be ...", "messages[0].role: ...") → 400, with that name,
  mapped back to the request's field, as `param` (and in the message).
Defaulting the open set to 400 keeps a new validation message of the model a 400 without a change here; a new
failure kind of the model must be added to the known prefixes (tests/openai checks the ones it can provoke).
Failures of the connection itself (Triton unreachable, a response cut off) are the bridge's: 503 and 502.
"""

from __future__ import annotations

import re

from pagedllm.openai.protocol import OpenAIError

_UNAVAILABLE = ("overloaded:", "engine is not running", "engine failed:", "engine is restarting",
                "the model is being unloaded", "request aborted", "request was cancelled")
_UNAVAILABLE_TRITON = ("unknown model", "is not ready", "no available versions")
_INTERNAL = ("request failed:", "could not process the request:")
# Triton core may put "[request id: <id>] " before a message.
_REQUEST_ID = re.compile(r"^\[request id: [^\]]*\]\s*")
# A validation message's leading field: `temperature:`, `messages[0].role:`, `sampling_parameters.top_k:`.
_FIELD = re.compile(r"^([A-Za-z_]\w*)((?:\[\d+\]|\.\w+)*):")


def from_stream_message(message: str, params: dict[str, str]) -> OpenAIError:
    """An error response's text → status and OpenAI error; `params` renames model inputs to request fields."""
    text = _REQUEST_ID.sub("", message.strip())
    lowered = text.lower()
    if lowered.startswith(_UNAVAILABLE) or any(p in lowered for p in _UNAVAILABLE_TRITON):
        return OpenAIError(503, text)
    if lowered.startswith(_INTERNAL):
        return OpenAIError(500, text)
    if lowered.startswith("lora_name:"):  # the adapter named by `model` is not served: no such model
        return OpenAIError(404, "model" + text[len("lora_name"):], "model", "model_not_found")
    param, text = _field(text, params)
    return OpenAIError(400, text, param)


def _field(text: str, params: dict[str, str]) -> tuple[str | None, str]:
    """(the request field a validation message names, the message naming that field rather than the input)."""
    body = text.removeprefix("sampling_parameters.")
    m = _FIELD.match(body)
    if m is None or m.group(1) == "sampling_parameters":
        return None, text
    head, rest = m.groups()
    param = params.get(head, head) + rest
    return param, param + body[m.end() - 1:]

