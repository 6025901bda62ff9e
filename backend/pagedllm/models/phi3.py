"""Phi-3 and Phi-4 (Phi3ForCausalLM): the Llama decoder with q/k/v and gate/up already fused in the checkpoint
(`qkv_proj`, `gate_up_proj`, split into our fused layers' shards at load), an optional sliding window on every
layer, and rotary over the first partial_rotary_factor of each head (Phi-4-mini: 0.75)."""

from pagedllm.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    packed_modules = {}  # the checkpoint's projections are fused already: checkpoint_splits says how

    @staticmethod
    def checkpoint_splits(config) -> dict[str, list[int]]:
        """Fused checkpoint module -> the rows of each of our fused layer's shards, in order."""
        d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
        return {"qkv_proj": [q, kv, kv], "gate_up_proj": [config.intermediate_size] * 2}

    @staticmethod
    def sliding_window(config):
        return getattr(config, "sliding_window", None)
