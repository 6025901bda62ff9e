"""Structured-output requests in both contracts, as the `structured_outputs` dict SamplingParams takes:

- vllm_backend: `structured_outputs` (vLLM >= 0.10) or `guided_decoding` (earlier) in `sampling_parameters`,
  an object (or its JSON text) with one of json, regex, choice, grammar, json_object, and optionally the
  `backend` that compiles it (guidance, xgrammar or auto; others, such as outlines, are refused by name);
- TensorRT-LLM: the `guided_decoding_guide_type` tensor (json, json_schema, regex, ebnf_grammar) with the
  `guided_decoding_guide` tensor (its text; none for json).
The spec itself (a valid schema, regex, grammar) is checked when the grammar compiles (InputProcessor).
"""

from __future__ import annotations

import json

_TRTLLM_TYPES = {"json": "json_object", "json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar"}


class StructuredInputError(ValueError):
    pass


def from_vllm(value, name: str) -> dict:
    """`structured_outputs` / `guided_decoding` from sampling_parameters."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise StructuredInputError(f"{name}: not valid JSON ({e.msg} at position {e.pos})") from None
    if not isinstance(value, dict):
        raise StructuredInputError(f"{name}: expected an object with one of json, regex, choice, grammar, "
                                   "json_object")
    return {k: v for k, v in value.items() if v is not None}  # a backend is checked with the spec


def from_trtllm(guide_type: str, guide: str | None) -> dict:
    if guide_type not in _TRTLLM_TYPES:
        raise StructuredInputError(f"guided_decoding_guide_type: expected one of {', '.join(_TRTLLM_TYPES)}, got "
                                   f"{guide_type!r}")
    kind = _TRTLLM_TYPES[guide_type]
    if kind == "json_object":
        return {"json_object": True}
    if not guide:
        raise StructuredInputError(f"guided_decoding_guide: is required with guided_decoding_guide_type {guide_type}")
    return {kind: guide}
