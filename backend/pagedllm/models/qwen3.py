"""Qwen3: Llama with per-head RMSNorm on q and k before rotary (head_dim may differ from hidden / heads); with
use_sliding_window, a sliding window on the layers config.layer_types marks."""

from pagedllm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def qk_norm(config):
        return True

    @staticmethod
    def sliding_window(config):
        return config.sliding_window if getattr(config, "use_sliding_window", False) else None
