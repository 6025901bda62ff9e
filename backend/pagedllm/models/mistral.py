"""Mistral: Llama with optional sliding-window attention."""

from pagedllm.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    @staticmethod
    def sliding_window(config):
        return getattr(config, "sliding_window", None)
