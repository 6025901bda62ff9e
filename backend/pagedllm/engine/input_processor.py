"""Turns what a caller asks for into a validated `ProcessedRequest`: the prompt tokenized (once), every token id
checked against the vocabulary, the length against the context.

It only reads the model's facts and its own tokenizer, so a front end runs it on its own thread with its own
tokenizer (the Triton adapter does) and the engine thread never validates the same request again.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.engine.model_info import ModelInfo
from pagedllm.sampling_params import SamplingParams

PromptType = str | dict | list[int]


@dataclass(frozen=True)
class ProcessedRequest:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    timeout: float | None = None  # seconds from arrival


class InputProcessor:
    def __init__(self, tokenizer, info: ModelInfo) -> None:
        self.tokenizer = tokenizer
        self.info = info

    def process(self, prompt: PromptType, params: SamplingParams | None = None, priority: int = 0,
                timeout: float | None = None) -> ProcessedRequest:
        """Raises ValueError naming the first problem."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        text, ids = self.tokenize(prompt)
        self.check_prompt(ids)
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout: must be > 0 seconds, got {timeout!r}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority: must be an integer, got {priority!r}")
        return ProcessedRequest(text, ids, params, priority, timeout)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompt: expected str, dict or list of token ids, got {type(prompt).__name__}")

    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt: is empty (no tokens)")
        limit = self.info.max_model_len
        if len(ids) >= limit:
            raise ValueError(f"prompt: {len(ids)} tokens leave no room to generate within max_model_len={limit}")
        vocab = self.info.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids: {bad[:5]} are not token ids in [0, {vocab})")
