"""Qwen2: Llama with a bias on the q/k/v projections; with use_sliding_window, a sliding window on the layers
config.layer_types marks (from max_window_layers on)."""

from pagedllm.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def qkv_bias(config):
        return True

    @staticmethod
    def sliding_window(config):
        return config.sliding_window if getattr(config, "use_sliding_window", False) else None
