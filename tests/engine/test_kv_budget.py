"""The KV budget: explicit bytes, or a fraction of the GPU (gpu_memory_utilization) less what the device
already holds and an activation reserve, or 1 GiB on CPU; both limits at once, or a GPU fraction on CPU, are
refused. And `dtype="auto"` keeps a float16 checkpoint in float16 on a GPU (bfloat16 on CPU)."""

from __future__ import annotations

import types

import pytest
import torch

from pagedllm import LLM
from pagedllm.config import CacheConfig
from pagedllm.engine.kv_budget import (CPU_DEFAULT_KV_BYTES, GiB, activation_reserve_bytes, budget_from_utilization,
                                       kv_budget_bytes)
from pagedllm.engine.model_info import _resolve_dtype

QWEN_05B = types.SimpleNamespace(hidden_size=896, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                                 intermediate_size=4864, vocab_size=151936)


def test_a_fraction_of_the_device_less_what_it_holds_and_the_reserve():
    total, free = 140 * GiB, 138 * GiB  # 2 GiB held already (weights, context, another process)
    assert budget_from_utilization(total, free, 0.9, GiB) == int(140 * GiB * 0.9) - 2 * GiB - GiB
    # another process holding most of the device leaves nothing: refused, with the figures
    with pytest.raises(ValueError, match=r"gpu_memory_utilization: 0.5 .* 100.00 GiB is in use"):
        budget_from_utilization(total, 40 * GiB, 0.5, GiB)


def test_the_activation_reserve_covers_a_step():
    small = activation_reserve_bytes(QWEN_05B, torch.bfloat16, 256, 8)
    large = activation_reserve_bytes(QWEN_05B, torch.bfloat16, 8192, 256)
    # 8192 tokens x (3 x 896 + 18 x 64 + 14 x 64 + 3 x 4864) bf16 values, plus 256 rows of fp32 logits twice
    assert large - small == (8192 - 256) * (3 * 896 + 18 * 64 + 14 * 64 + 3 * 4864) * 2 + 2 * (256 - 8) * 151936 * 4
    # tensor parallel ranks each hold their share of the sharded activations
    assert activation_reserve_bytes(QWEN_05B, torch.bfloat16, 8192, 256, tensor_parallel_size=2) < large


def test_cpu_budgets():
    assert kv_budget_bytes(CacheConfig(), "cpu", QWEN_05B, torch.bfloat16, 2048, 64) == CPU_DEFAULT_KV_BYTES
    assert kv_budget_bytes(CacheConfig(kv_cache_memory_bytes=123456), "cpu", QWEN_05B, torch.bfloat16, 2048,
                           64) == 123456
    with pytest.raises(ValueError, match="gpu_memory_utilization: sizes the KV cache of a GPU"):
        kv_budget_bytes(CacheConfig(gpu_memory_utilization=0.5), "cpu", QWEN_05B, torch.bfloat16, 2048, 64)
    with pytest.raises(ValueError, match="give one of them"):
        kv_budget_bytes(CacheConfig(kv_cache_memory_bytes=1 << 20, gpu_memory_utilization=0.5), "cuda",
                        QWEN_05B, torch.bfloat16, 2048, 64)


def test_a_draft_model_shares_the_device_fraction_only(monkeypatch):
    """On a GPU the draft's KV (a quarter of the target's) comes out of the fraction; an explicit or CPU budget
    is the target's alone, as before."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (138 * GiB, 140 * GiB))
    alone = kv_budget_bytes(CacheConfig(), "cuda:0", QWEN_05B, torch.bfloat16, 2048, 64)
    shared = kv_budget_bytes(CacheConfig(), "cuda:0", QWEN_05B, torch.bfloat16, 2048, 64, shared_with_draft=True)
    assert alone > 0 and shared == alone - alone // 5 and shared + shared // 4 <= alone
    assert kv_budget_bytes(CacheConfig(), "cpu", QWEN_05B, torch.bfloat16, 2048, 64,
                           shared_with_draft=True) == CPU_DEFAULT_KV_BYTES
    assert kv_budget_bytes(CacheConfig(kv_cache_memory_bytes=1 << 20), "cuda:0", QWEN_05B, torch.bfloat16, 2048,
                           64, shared_with_draft=True) == 1 << 20


@pytest.mark.parametrize("bad", [0, 1.5, -0.1, True, "0.9"])
def test_a_bad_fraction_is_refused(bad):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        CacheConfig(gpu_memory_utilization=bad)


def test_the_started_engine_states_its_budget_in_bytes(llama_dir):
    llm = LLM(llama_dir, dtype="float32", max_model_len=256)
    assert llm.engine.config.cache.kv_cache_memory_bytes == CPU_DEFAULT_KV_BYTES
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(llama_dir, dtype="float32", max_model_len=256, gpu_memory_utilization=0.5)


def test_auto_keeps_float16_on_a_gpu_only():
    fp16 = types.SimpleNamespace(dtype=torch.float16)
    assert _resolve_dtype("auto", fp16, "cuda:1") == torch.float16
    assert _resolve_dtype("auto", fp16, "cpu") == torch.bfloat16
    assert _resolve_dtype("float16", fp16, "cpu") == torch.float16  # asked for explicitly: honoured
    assert _resolve_dtype("auto", types.SimpleNamespace(dtype="bfloat16"), "cuda") == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_cache_fills_the_fraction(llama_dir):
    llm = LLM(llama_dir, dtype="float16", max_model_len=256, gpu_memory_utilization=0.3)
    free, total = torch.cuda.mem_get_info()
    held = total - free
    assert llm.engine.config.cache.kv_cache_memory_bytes > 0
    assert 0.2 * total < held <= 0.3 * total  # the KV cache took the fraction, and no more
