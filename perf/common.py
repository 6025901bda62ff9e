"""Helpers shared by the perf scripts: model directories, matmul peak, JSON lines."""

from __future__ import annotations

import json
import os
import random
import time

import numpy as np
import torch

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
PERF_MAX_POSITIONS = 4096


def model_dir(arch: str, size: str, dtype: str = "bfloat16") -> str:
    """Make (once) and return a cached perf model directory."""
    from pagedllm.tiny_model import make_tiny_model

    path = os.path.join(OUT_DIR, "models", f"{arch}-{size}-{dtype}")
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        make_tiny_model(path, arch=arch, size=size, dtype=dtype)
    with open(config_path) as f:
        config = json.load(f)
    if config["max_position_embeddings"] < PERF_MAX_POSITIONS:  # the grid's long cells need 2,512 positions
        config["max_position_embeddings"] = PERF_MAX_POSITIONS
        with open(config_path, "w") as f:
            json.dump(config, f, indent=2)
    return path


def build_kernel_source(source: str, function: str, declaration: str = '#include "ops.h"'):
    """Another version of one of our C++ CPU kernel sources (say `git show REV:kernels/...cpp > /tmp/old.cpp`),
    built as an extension of its own beside our headers, for A/B timings: returns its `function`. `declaration`
    declares that function to the bindings (ops.h's by default; an older source may have another signature)."""
    return getattr(build_kernel_module(source, [function], declaration), function)


def build_kernel_module(source: str, functions: list[str], declaration: str = '#include "ops.h"'):
    """As build_kernel_source, binding several of the source's functions in one build: returns the module."""
    import hashlib
    import pathlib
    import tempfile

    from torch.utils.cpp_extension import load

    from pagedllm_kernels.cpu.build import _CFLAGS, _LDFLAGS

    kernels = pathlib.Path(__file__).resolve().parents[1] / "kernels" / "pagedllm_kernels" / "cpu"
    work = pathlib.Path(tempfile.mkdtemp(prefix="pagedllm-other-"))
    bindings = work / "bindings.cpp"
    defs = " ".join(f'm.def("{f}", &{f});' for f in functions)
    bindings.write_text(f'#include <torch/extension.h>\n{declaration}\n'
                        f'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{ {defs} }}\n')
    digest = hashlib.sha256(pathlib.Path(source).read_bytes() + declaration.encode()).hexdigest()[:10]
    return load(name=f"pagedllm_other_{'_'.join(functions)}_{digest}", sources=[os.path.abspath(source), str(bindings)],
                extra_include_paths=[str(kernels)], extra_cflags=list(_CFLAGS), extra_ldflags=list(_LDFLAGS))


def quantized_model_dir(arch: str, size: str, kind: str) -> str:
    """Make (once) and return the perf model quantized: "awq" or "gptq" (symmetric) int4, group size 128;
    "fp8" (compressed-tensors, per-channel weights, dynamic per-token activations: llm-compressor's FP8_DYNAMIC)."""
    from pagedllm.models.quantization.tiny_checkpoints import make_fp8_checkpoint, make_int4_checkpoint

    path = os.path.join(OUT_DIR, "models", f"{arch}-{size}-{kind}")
    if not os.path.exists(os.path.join(path, "config.json")):
        if kind == "fp8":
            make_fp8_checkpoint(model_dir(arch, size), path, "compressed-tensors", "channel", "dynamic_token")
        else:
            make_int4_checkpoint(model_dir(arch, size), path, kind, 128, desc_act=False, sym=kind == "gptq")
    return path


def random_workload(n: int, min_len: int, max_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(n)]


def matmul_peak_flops(dtype: torch.dtype, n: int = 2048, seconds: float = 1.5) -> float:
    """Measured FLOP/s of a square matmul on this machine, now (the ceiling for our ratios)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    iters, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        iters += 1
    return 2 * n ** 3 * iters / (time.perf_counter() - t0)


def model_flops_per_token(hf_config) -> float:
    """2 x matmul parameters (attention scores excluded): the usual forward-pass estimate."""
    h, i, L = hf_config.hidden_size, hf_config.intermediate_size, hf_config.num_hidden_layers
    d = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * d, hf_config.num_key_value_heads * d
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
    return 2.0 * (L * per_layer + h * hf_config.vocab_size)


def pct(values: list[float], q: float) -> float:
    """The q-quantile (0-1) of `values`, interpolated linearly between ranks as numpy and genai-perf do: of 16
    samples, p99 reads between the largest two rather than being the largest alone."""
    return float(np.percentile(values, 100 * q)) if len(values) else float("nan")


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)
