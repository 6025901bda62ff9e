"""Quantized models through the real tritonserver: an AWQ checkpoint with the fp8 KV cache, and a dense one
quantized to int8 at load, each set in engine.json; served tokens equal the offline engine's with the same
settings, the metrics count the KV blocks the fp8 cache doubles, and every block returns. Both engines take the
same attention backend by name: raced in two processes on a loaded host, `auto` can pick differently in each, and
bf16 tokens from two kernels may differ."""

from __future__ import annotations

import pytest
import triton_server
from pagedllm import LLM, SamplingParams
from pagedllm.models.quantization.tiny_checkpoints import make_int4_checkpoint
from pagedllm_kernels.cpu import int8_linear
from serving_client import grpc_call, grpc_inputs

pytestmark = pytest.mark.server
PARAMS = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}


def served_equals_offline(tmp_path, model, engine):
    offline = LLM(model, **engine)
    want = offline.generate(["def main():"], SamplingParams(**PARAMS), use_tqdm=False)[0].outputs[0].text
    blocks = offline.engine.kv.pool.num_blocks - 1
    offline.shutdown()
    server = triton_server.start(tmp_path / "triton", model, engine)
    try:
        text, err = grpc_call(server, grpc_inputs("def main():", PARAMS, stream=True))
        assert err is None and text == want
        m = server.wait_metrics(server.all_blocks_free)
        assert server.all_blocks_free(m) and m["pagedllm:kv_blocks_total"] == blocks
        return blocks
    finally:
        triton_server.stop(server)


def test_awq_with_the_fp8_kv_cache_served(llama_dir, tmp_path):
    awq, _ = make_int4_checkpoint(llama_dir, str(tmp_path / "awq"), "awq", 128, desc_act=False, sym=False)
    engine = {"dtype": "bfloat16", "kv_cache_memory_bytes": 4 << 20, "max_model_len": 256, "device": "cpu",
              "attention_backend": "torch"}
    blocks = served_equals_offline(tmp_path / "fp8", awq, {**engine, "kv_cache_dtype": "fp8"})
    bf16_blocks = LLM(awq, **engine).engine.kv.pool.num_blocks - 1
    assert blocks + 1 == 2 * (bf16_blocks + 1)  # the same budget, twice the blocks (the null block included)


@pytest.mark.skipif(not int8_linear.vnni_supported()[0], reason=int8_linear.vnni_supported()[1])
def test_int8_at_load_served(llama_dir, tmp_path):
    served_equals_offline(tmp_path, llama_dir, {"dtype": "bfloat16", "kv_cache_memory_bytes": 4 << 20,
                                                "max_model_len": 256, "device": "cpu", "quantization": "int8",
                                                "attention_backend": "torch"})
