"""A mixture-of-experts model through the real tritonserver: served tokens equal the offline engine's, and
`pagedllm:moe_expert_tokens_total{layer, expert}` counts every routed token (top-2: twice the tokens computed)."""

from __future__ import annotations

import pytest
import triton_server
from pagedllm import LLM, SamplingParams
from pagedllm.tiny_model import make_variant_model
from serving_client import grpc_call, grpc_inputs

pytestmark = pytest.mark.server


def test_mixtral_served_and_its_expert_load_exported(tmp_path):
    d = make_variant_model(str(tmp_path / "mixtral"), arch="mixtral")
    params = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
    offline = LLM(d, dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=256)
    want = offline.generate(["def main():"], SamplingParams(**params), use_tqdm=False)[0]
    server = triton_server.start(tmp_path / "triton", d, {"dtype": "float32", "kv_cache_memory_bytes": 8 << 20,
                                                          "max_model_len": 256})
    try:
        text, err = grpc_call(server, grpc_inputs("def main():", params, stream=True))
        assert err is None and text == want.outputs[0].text
        computed = len(want.prompt_token_ids) + 7  # the prompt, then 7 decodes
        # One publish increments the counters one by one: a scrape can fall between two layers' increments, so
        # wait for every layer's count (a count that never arrives, or overshoots, still fails).
        m = server.wait_metrics(lambda m: expert_tokens_per_layer(m) == {"0": 2 * computed, "1": 2 * computed})
        assert expert_tokens_per_layer(m) == {"0": 2 * computed, "1": 2 * computed}
    finally:
        triton_server.stop(server)


def expert_tokens_per_layer(m: dict[str, float]) -> dict[str, float]:
    per_layer: dict[str, float] = {}
    for key, value in m.items():
        if key.startswith("pagedllm:moe_expert_tokens_total"):
            layer = key.split('layer="')[1].split('"')[0]
            per_layer[layer] = per_layer.get(layer, 0) + value
    return per_layer
