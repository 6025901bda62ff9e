"""The offline API, shaped like vLLM's: `LLM(model=DIR, ...).generate(prompts, sampling_params)`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tqdm import tqdm

from pagedllm.config import EngineConfig
from pagedllm.engine.engine import LLMEngine
from pagedllm.engine.input_processor import PromptType
from pagedllm.engine.stats import EngineStats
from pagedllm.lora_request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class LLM:
    """Engine arguments are keyword arguments: dtype, block_size, kv_cache_memory_bytes, max_num_seqs,
    max_num_batched_tokens, max_model_len, seed, enable_prefix_caching, enable_chunked_prefill,
    scheduling_policy, attention_backend, enable_lora, max_loras, max_lora_rank, lora_modules ... (see
    pagedllm.config)."""

    def __init__(self, model: str, **engine_args) -> None:
        self.engine = LLMEngine(EngineConfig.from_kwargs(model, **engine_args))

    def shutdown(self) -> None:
        """Stop tensor-parallel worker processes now (they also stop when this process exits)."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_stats(self) -> EngineStats:
        return self.engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        timeout: float | Sequence[float | None] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run all prompts to completion with continuous batching; outputs come back in input order.
        `lora_request`: the adapter for every prompt, or one per prompt (None: the base model; needs
        enable_lora).

        Every prompt is tokenized and validated before any is queued, so a bad one raises ValueError without
        side effects. Each request yields only its final output (as vLLM's LLM does).
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        n = len(prompts)
        params = _per_prompt(sampling_params if sampling_params is not None else SamplingParams(), n,
                             "sampling_params")
        priorities = _per_prompt(priority if priority is not None else 0, n, "priority")
        timeouts = _per_prompt(timeout, n, "timeout")
        loras = _per_prompt(lora_request, n, "lora_request")
        process = self.engine.input_processor.process
        return self._run([process(p, _final_only(sp), pr, t, lora)
                          for p, sp, pr, t, lora in zip(prompts, params, priorities, timeouts, loras)], use_tqdm)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False,
                    lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Beam search for each prompt (transformers' rules): one RequestOutput per prompt whose outputs are
        its `beam_width` beams, best first, each with its tokens, text and cumulative logprob. The beams share
        their common blocks of KV by reference count."""
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params: expected BeamSearchParams, got {type(params).__name__}")
        return self.generate(prompts, params.sampling_params(), use_tqdm=use_tqdm, lora_request=lora_request)

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of OpenAI-format messages) or to several (a list of
        such lists), rendered with the chat template: `chat_template` (a Jinja string or a file), else the
        engine's `chat_template`, else the tokenizer's. Raises ValueError for a malformed conversation or a
        model without a template, before anything is queued."""
        conversations = [messages] if not messages or isinstance(messages[0], dict) else list(messages)
        params = _per_prompt(sampling_params if sampling_params is not None else SamplingParams(),
                             len(conversations), "sampling_params")
        loras = _per_prompt(lora_request, len(conversations), "lora_request")
        process = self.engine.input_processor.process_chat
        return self._run([process(conv, _final_only(sp), chat_template=chat_template,
                                  add_generation_prompt=add_generation_prompt, lora=lora)
                          for conv, sp, lora in zip(conversations, params, loras)], use_tqdm)

    def _run(self, processed: list, use_tqdm: bool) -> list[RequestOutput]:
        n = len(processed)
        ids: list[str] = []
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=n, desc="Processed prompts", disable=not use_tqdm)
        try:
            for p in processed:  # e.g. a full queue (max_queue_size) raises here: the added ones are aborted
                ids.append(self.engine.add_request(p))
            while len(results) < n:
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:  # a failed tensor-parallel worker, an interrupt: release what this call holds
            for rid in ids:
                if rid not in results:
                    self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]


def _final_only(params):
    """The caller's parameters asking for the final output only (the caller's object is left as it is)."""
    if not isinstance(params, SamplingParams):
        return params  # the input processor names the problem
    return dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name}: {len(value)} values for {n} prompts")
        return list(value)
    return [value] * n
