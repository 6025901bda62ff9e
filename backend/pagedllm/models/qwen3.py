"""Qwen3: Llama with per-head RMSNorm on q and k before rotary."""

from pagedllm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def qk_norm(config):
        return True

    @staticmethod
    def sliding_window(config):
        if getattr(config, "use_sliding_window", False):
            raise NotImplementedError("Qwen3 sliding-window attention is not supported")
