"""Qwen2: Llama with a bias on the q/k/v projections."""

from pagedllm.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def qkv_bias(config):
        return True

    @staticmethod
    def sliding_window(config):
        if getattr(config, "use_sliding_window", False):
            raise NotImplementedError("Qwen2 sliding-window attention (use_sliding_window) is not supported")
