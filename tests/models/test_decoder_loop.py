"""The decoder's layers in one C++ call (models/decoder_loop.py) give exactly what the modules give: the
same kernels in the same order, so every greedy token and every logprob is equal, for each part a layer may
have (q/k/v bias, per-head q/k norms, a sliding window, MLP bias, an fp8 cache), and for a step of more rows
than the loop takes (the modules run it). Models the loop cannot run keep the modules."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import assert_all_blocks_free, random_prompts

from pagedllm import LLM, SamplingParams
from pagedllm.models import decoder_loop
from pagedllm.models.layers import packed_linear
from pagedllm.models.layers.int4_linear import CPU_KERNEL_ROWS
from pagedllm.models.quantization.tiny_checkpoints import make_fp8_checkpoint, make_int4_checkpoint
from pagedllm.tiny_model import make_variant_model
from pagedllm_kernels.cpu import build
from pagedllm_kernels.cpu import decoder_loop as loop_ops

pytestmark = pytest.mark.skipif(not build.cpu_supported()[0], reason="the C++ kernels need AVX512-BF16")

LENGTHS = [1, 5, 17, 40, 100, 64, 129]
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
# The cpu backend named: the startup benchmark, on a loaded host, can pick another (which the loop does not run).
ENGINE = dict(dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=32 << 20, attention_backend="cpu")


@pytest.fixture(autouse=True)
def fixed_linear_race(monkeypatch):
    """The load-time race (linear_race.py) picks per engine where oneDNN takes over from our kernel; on a loaded
    host two engines can pick differently, and oneDNN's sums differ from ours in the last bits. So every engine
    here gets one outcome: our kernel up to 16 rows (decodes, short prompts), oneDNN above (longer prompts)."""
    monkeypatch.setattr(packed_linear, "race_tile_rows", lambda named: (16, True, []))


@pytest.fixture
def loop_calls(monkeypatch):
    """How many steps went through the loop."""
    calls = []
    run = decoder_loop.DecoderLoop.__call__

    def counted(self, *args):
        calls.append(args[0].shape[0])
        return run(self, *args)

    monkeypatch.setattr(decoder_loop.DecoderLoop, "__call__", counted)
    return calls


def outputs(llm):
    outs = llm.generate([{"prompt_token_ids": p} for p in random_prompts(LENGTHS)], PARAMS, use_tqdm=False)
    assert_all_blocks_free(llm)
    return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in row.items()} for row in o.outputs[0].logprobs])
            for o in outs]


def loop_of(llm):
    return llm.engine.executor.model.model.decoder_loop


def compare(model: str, loop_calls, **kw):
    with_loop = LLM(model, **ENGINE, **kw)
    assert loop_of(with_loop) is not None
    ours = outputs(with_loop)
    assert loop_calls, "no step went through the loop"
    modules = LLM(model, **ENGINE, cpu_decoder_loop=False, **kw)
    assert loop_of(modules) is None
    assert ours == outputs(modules)
    return with_loop


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_the_loop_gives_the_modules_tokens_and_logprobs(model_dir, loop_calls, arch):
    compare(model_dir(arch), loop_calls)  # qwen2: q/k/v bias; qwen3: per-head q/k norms


@pytest.mark.parametrize("changes", [{"sliding_window": 24}, {"mlp_bias": True}], ids=["window", "mlp_bias"])
def test_the_loop_takes_windows_and_mlp_bias(tmp_path, loop_calls, changes):
    arch = "mistral" if "sliding_window" in changes else "llama"
    compare(make_variant_model(str(tmp_path), arch, **changes), loop_calls)


def test_the_loop_reads_and_writes_an_fp8_cache(llama_dir, loop_calls):
    compare(llama_dir, loop_calls, kv_cache_dtype="fp8")


@pytest.mark.parametrize("method,group,desc_act", [("awq", 32, False), ("gptq", 64, True)], ids=["awq", "gptq_desc_act"])
def test_the_loop_runs_int4_linears(llama_dir, tmp_path, loop_calls, method, group, desc_act):
    """Up to the int4 kernel's 64 rows (the 100- and 129-token prompts' steps take the modules)."""
    quantized, _ = make_int4_checkpoint(llama_dir, str(tmp_path / method), method, group, desc_act, sym=False)
    llm = compare(quantized, loop_calls)
    assert loop_of(llm).max_rows == CPU_KERNEL_ROWS


@pytest.mark.parametrize("activations", [None, "dynamic", "dynamic_token", "static"])
def test_the_loop_runs_fp8_linears(llama_dir, tmp_path, loop_calls, activations):
    """Weight-only, and with the activations rounded to e4m3 per tensor, per token or at the checkpoint's static
    scale. No row limit: the prompts' steps (up to 129 rows) go through the loop too."""
    quantized, _ = make_fp8_checkpoint(llama_dir, str(tmp_path / "fp8"), "compressed-tensors", "channel", activations)
    compare(quantized, loop_calls)
    assert max(loop_calls) > CPU_KERNEL_ROWS


@pytest.mark.skipif(not build.vnni_supported()[0], reason="W8A8 needs AVX512-VNNI")
def test_the_loop_runs_int8_linears(llama_dir, loop_calls):
    compare(llama_dir, loop_calls, quantization="int8")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_steps_above_the_tiles_rows_go_through_the_loop_on_onednn(model_dir, loop_calls, monkeypatch, arch):
    """bf16 linears take every step in the loop: up to the raced rows on our tiles, above on oneDNN's packed
    matmul as PackedLinear calls it (qwen2: with the q/k/v bias). With the race pinned at 8 rows, the prompts'
    steps (17-129 rows) take oneDNN inside the loop, and the tokens and logprobs are still the modules'."""
    monkeypatch.setattr(packed_linear, "race_tile_rows", lambda named: (8, True, []))
    llm = compare(model_dir(arch), loop_calls)
    assert loop_of(llm).max_rows == decoder_loop.UNLIMITED
    assert max(loop_calls) > 8


def test_the_loop_pads_onednn_rows_as_the_modules_do():
    """Each row count the loop gives oneDNN is packed_linear.bucket_rows's, so a process meets the same few dozen
    primitive shapes whichever path runs a step (an unbucketed size costs a primitive per weight shape)."""
    sizes = range(1, 8193)
    assert [loop_ops.onednn_rows(n) for n in sizes] == [packed_linear.bucket_rows(n) for n in sizes]


def test_steps_of_more_rows_than_the_loop_takes_run_through_the_modules(llama_dir, loop_calls, monkeypatch):
    """With the loop's limit at 8 rows, the longer prompts' steps take the modules and the decodes the loop:
    still the modules' tokens."""
    monkeypatch.setattr(decoder_loop.DecoderLoop, "takes", lambda self, rows, caches, meta: rows <= 8)
    compare(llama_dir, loop_calls)
    assert max(loop_calls) <= 8


@pytest.mark.parametrize("kw, why", [
    (dict(dtype="float32"), "a model not bf16 on CPU"),
    (dict(attention_backend="torch"), "attention backend"),
    (dict(enable_lora=True, max_lora_rank=8), "LoRA"),
], ids=["fp32", "torch_backend", "lora"])
def test_models_the_loop_cannot_run_keep_the_modules(llama_dir, kw, why, caplog):
    caplog.set_level("INFO", logger=decoder_loop.__name__)
    llm = LLM(llama_dir, **{**ENGINE, **kw})
    assert loop_of(llm) is None
    assert why in caplog.text
    assert outputs(llm)[0][0]  # it still generates


def test_the_switch_is_reported(llama_dir):
    llm = LLM(llama_dir, **ENGINE, cpu_decoder_loop=False)
    assert llm.get_stats().kernels["cpu_decoder_loop"] is False
    with pytest.raises(ValueError, match="cpu_decoder_loop"):
        LLM(llama_dir, **ENGINE, cpu_decoder_loop="yes")


@pytest.mark.skipif(not build.amx_supported()[0], reason="needs AMX")
def test_the_amx_attention_switch_reaches_the_backend_and_the_loop(llama_dir, loop_calls):
    """Off, the prompts' attention stays on AVX-512 in the loop as in the modules (their tokens and logprobs are
    equal, where one of them on AMX would part in the last bits); on, the backend takes AMX."""
    llm = compare(llama_dir, loop_calls, amx_attention=False)
    assert llm.engine.backend.amx is False and llm.get_stats().kernels["amx_attention"] is False
    assert max(loop_calls) > 1  # a prompt's step went through the loop
    assert LLM(llama_dir, **ENGINE).engine.backend.amx is True


def test_unsupported_names_a_reason_for_a_model_outside_the_family():
    assert "decoder" in decoder_loop.unsupported(torch.nn.Linear(2, 2), None)


def test_the_loop_clocks_its_attention_and_linears(llama_dir, monkeypatch):
    """perf/attention_share.py reads the loop's own clocks of its KV stores and attention kernels and of its
    linears: each starts at 0 and runs while the loop does, and the two stay below the loop's whole time."""
    in_loop = []
    run = decoder_loop.DecoderLoop.__call__

    def timed(self, *args):
        t0 = time.perf_counter()
        out = run(self, *args)
        in_loop.append(time.perf_counter() - t0)
        return out

    monkeypatch.setattr(decoder_loop.DecoderLoop, "__call__", timed)
    llm = LLM(llama_dir, **ENGINE)
    loop = loop_of(llm)
    assert loop.attention_seconds == 0.0 and loop.linear_seconds == 0.0
    outputs(llm)
    assert in_loop and loop.attention_seconds > 0.0 and loop.linear_seconds > 0.0
    assert loop.attention_seconds + loop.linear_seconds < sum(in_loop)
