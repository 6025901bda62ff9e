"""Turns what a caller asks for into a validated `ProcessedRequest`: the prompt tokenized (once), every token id
a request carries checked against the vocabulary, lengths and counts against the context and the request
limits (`EngineConfig.limits`). Any problem is a ValueError naming the field, raised before anything is queued.

It only reads the model's facts and its own tokenizer, so a front end runs it on its own thread with its own
tokenizer (the Triton adapter does) and the engine thread never validates the same request again.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.config import LoRAConfig, RequestLimits
from pagedllm.engine.chat_template import ChatTemplate
from pagedllm.engine.logits_controls import tokenize_bad_words
from pagedllm.engine.lora_registry import LoRARegistry
from pagedllm.engine.model_info import ModelInfo
from pagedllm.engine.structured_output.compiler import GrammarCompiler
from pagedllm.lora_request import LoRARequest
from pagedllm.sampling_params import SamplingParams

PromptType = str | dict | list[int]


@dataclass(frozen=True)
class ProcessedRequest:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    timeout: float | None = None  # seconds from arrival
    grammar: object | None = None  # the compiled grammar of params.structured_outputs
    bad_words_token_ids: tuple = ()  # params.bad_words tokenized (engine.logits_controls)
    lora: LoRARequest | None = None  # the adapter it runs with
    lora_weights: object | None = None  # its LoRAAdapter (checked against the model): the engine reads no file
    # When the request was received (time.monotonic()); None: when the engine takes it. A server sets it: the
    # engine takes requests only between steps, and the wait for the step in progress (up to a prefill chunk's
    # step, ~0.5 s on 2 cores) is part of its queue time, TTFT and deadline.
    arrival_time: float | None = None


class InputProcessor:
    def __init__(self, tokenizer, info: ModelInfo, limits: RequestLimits | None = None,
                 chat_template: str | None = None, lora: LoRAConfig | None = None,
                 structured_outputs_backend: str = "auto") -> None:
        self.tokenizer = tokenizer
        self.structured_outputs_backend = structured_outputs_backend
        self.loras = LoRARegistry(lora or LoRAConfig(), info.hf_config)
        self.chat = ChatTemplate(tokenizer, chat_template)
        self._grammar_compiler: GrammarCompiler | None = None  # made on the first constrained request
        self.info = info
        self.limits = limits or RequestLimits()
        default = info.max_model_len - 1
        self.max_prompt_tokens = min(default, self.limits.max_prompt_tokens or default)

    def process(self, prompt: PromptType, params: SamplingParams | None = None, priority: int = 0,
                timeout: float | None = None, lora=None) -> ProcessedRequest:
        """`lora`: a LoRARequest, or a declared adapter's name or id (LoRARegistry.resolve). Raises ValueError
        naming the first problem."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected SamplingParams, got {type(params).__name__}")
        self.check_params(params)
        if timeout is not None and not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
                                        and 0 < timeout < float("inf")):
            raise ValueError(f"timeout: must be a finite number of seconds > 0, got {timeout!r}")
        if not isinstance(priority, int) or isinstance(priority, bool) or not -2 ** 63 <= priority < 2 ** 63:
            raise ValueError(f"priority: must be a 64-bit integer, got {priority!r}")
        text, ids = self.tokenize(prompt)
        if params.truncate_prompt_tokens is not None:  # vLLM's: the last k tokens (the text stays as given)
            ids = ids[-params.truncate_prompt_tokens:]
        self.check_prompt(ids)
        lora, weights = self.loras.resolve(lora)
        return ProcessedRequest(text, ids, params, priority, timeout, self.compile_grammar(params),
                                tuple(tokenize_bad_words(self.tokenizer, params.bad_words)), lora, weights)

    def compile_grammar(self, params: SamplingParams):
        """The request's compiled grammar (cached per spec), or None; ValueError for an invalid spec."""
        if params.structured_outputs is None:
            return None
        if self._grammar_compiler is None:
            self._grammar_compiler = GrammarCompiler(self.tokenizer, self.info.vocab_size, self.info.eos_token_ids,
                                                     self.structured_outputs_backend)
        return self._grammar_compiler.compile(params.structured_outputs)

    def process_chat(self, messages, params: SamplingParams | None = None, priority: int = 0,
                     timeout: float | None = None, chat_template: str | None = None,
                     add_generation_prompt: bool = True, lora=None) -> ProcessedRequest:
        """A conversation rendered with the chat template, then processed as its prompt. The rendered text
        carries the template's special tokens (BOS included, where the template writes one), so the tokenizer
        adds none of its own, as vLLM does for chat."""
        text = self.chat.render(messages, add_generation_prompt, chat_template)
        self.check_prompt_size(text)
        return self.process({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)},
                            params, priority, timeout, lora)

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot know alone: the vocabulary and this server's limits."""
        lim = self.limits
        if len(params.stop) > lim.max_stop_strings:
            raise ValueError(f"stop: {len(params.stop)} strings, at most {lim.max_stop_strings} allowed")
        long = [s for s in params.stop if len(s) > lim.max_stop_string_chars]
        if long:
            raise ValueError(f"stop: a string of {len(long[0])} characters, at most {lim.max_stop_string_chars} allowed")
        if len(params.stop_token_ids) > lim.max_stop_token_ids:
            raise ValueError(f"stop_token_ids: {len(params.stop_token_ids)} ids, at most {lim.max_stop_token_ids} "
                             "allowed")
        self.check_token_ids("stop_token_ids", params.stop_token_ids)
        if params.logit_bias:
            self.check_token_ids("logit_bias", list(params.logit_bias))
        if params.allowed_token_ids is not None:
            self.check_token_ids("allowed_token_ids", params.allowed_token_ids)
        if len(params.bad_words) > lim.max_stop_strings:
            raise ValueError(f"bad_words: {len(params.bad_words)} words, at most {lim.max_stop_strings} allowed")
        if params.logprobs is not None and params.logprobs > lim.max_logprobs:
            raise ValueError(f"logprobs: {params.logprobs} requested, at most {lim.max_logprobs} allowed")
        if params.prompt_logprobs is not None and params.prompt_logprobs > lim.max_logprobs:
            raise ValueError(f"prompt_logprobs: {params.prompt_logprobs} requested, at most {lim.max_logprobs} "
                             "allowed")

    def check_token_ids(self, name: str, ids: list[int]) -> None:
        """Every id in [0, vocab_size): an id outside would index past the embedding or the logits."""
        vocab = self.info.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name}: {[_short(t) for t in bad[:5]]} not token ids in [0, {vocab})")

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            self.check_prompt_size(prompt)
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text = prompt.get("prompt")
                if text is not None and not isinstance(text, str):
                    raise ValueError(f"prompt: expected a string, got {type(text).__name__}")
                return text, self._id_list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise ValueError("prompt: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)):
            return None, self._id_list(prompt)
        raise ValueError(f"prompt: expected str, dict or list of token ids, got {type(prompt).__name__}")

    def check_prompt_size(self, text: str) -> None:
        size = len(text.encode("utf-8", errors="surrogatepass"))
        if size > self.limits.max_prompt_bytes:
            raise ValueError(f"prompt: {size} bytes, at most {self.limits.max_prompt_bytes} allowed")

    @staticmethod
    def _id_list(ids) -> list[int]:
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"prompt_token_ids: expected a list of token ids, got {type(ids).__name__}")
        return list(ids)

    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt: is empty (no tokens)")
        if len(ids) > self.max_prompt_tokens:
            raise ValueError(f"prompt: {len(ids)} tokens, at most {self.max_prompt_tokens} allowed (max_model_len="
                             f"{self.info.max_model_len} leaves room for one generated token)")
        self.check_token_ids("prompt_token_ids", ids)


def _short(value):
    """A bad id as it goes into a message: huge integers and long values cut down."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"<{value.bit_length()}-bit integer>"
    text = repr(value)
    return value if len(text) <= 40 else text[:37] + "..."
