"""FP8-weight checkpoints (compressed-tensors and `fp8`, per-tensor and per-channel scales, activations none,
dynamic or static) through the engine against transformers (fp32) on their dequantized twins
(pagedllm/models/quantization/tiny_checkpoints.py). Weight-only in fp32: logits to fp32 rounding, greedy
tokens identical. Activations rounded to e4m3 (the format's own numerics, which the dense twin does not
have), or bf16 through our C++ kernel: teacher-forced tokens agree wherever the twin's margin allows."""

import pytest
import torch
from conftest import TINY_VOCAB, agreement_with_transformers, assert_all_blocks_free, random_prompts, vocab_log_probs
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.models.layers.fp8_linear import Fp8Linear
from pagedllm.models.quantization.tiny_checkpoints import make_fp8_checkpoint

LENGTHS = [1, 5, 17, 40, 100, 64]
MAX_TOKENS = [12, 5, 16, 8, 8, 10]
FLIP_MARGIN = 0.5  # logprob units: e4m3 activations are off by up to 1/16 of themselves


@pytest.fixture(scope="module")
def checkpoints(model_dir, tmp_path_factory):
    made = {}

    def get(arch, method, strategy, activations):
        key = (arch, method, strategy, activations)
        if key not in made:
            out = tmp_path_factory.mktemp("fp8") / "-".join(map(str, key))
            made[key] = make_fp8_checkpoint(model_dir(arch), str(out), method, strategy, activations)
        return made[key]

    return get


def hf_greedy(model_dir, prompts):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf, [hf.generate(torch.tensor([p]), max_new_tokens=m, min_new_tokens=m, do_sample=False)[0, len(p):]
                    .tolist() for p, m in zip(prompts, MAX_TOKENS)]


@pytest.mark.parametrize("method,strategy", [("compressed-tensors", "tensor"), ("compressed-tensors", "channel")])
def test_weight_only_fp32_matches_transformers(checkpoints, method, strategy):
    quantized, twin = checkpoints("llama", method, strategy, None)
    prompts = random_prompts(LENGTHS)
    hf, want = hf_greedy(twin, prompts)
    llm = LLM(quantized, dtype="float32", max_model_len=512, kv_cache_memory_bytes=16 << 20,
              max_logprobs=TINY_VOCAB)
    assert sum(isinstance(m, Fp8Linear) for m in llm.engine.executor.model.modules()) == 8
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    scored = llm.generate([{"prompt_token_ids": prompts[2]}],
                          SamplingParams(max_tokens=1, prompt_logprobs=TINY_VOCAB), use_tqdm=False)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompts[2]])).logits[0].log_softmax(-1)
    torch.testing.assert_close(vocab_log_probs(scored), ref[:-1], atol=1e-4, rtol=1e-4)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("arch,method,strategy,activations,dtype", [
    ("llama", "compressed-tensors", "channel", "dynamic_token", "float32"),
    ("llama", "compressed-tensors", "tensor", "static", "float32"),
    ("llama", "fp8", "tensor", "dynamic", "bfloat16"),
    ("qwen2", "fp8", "tensor", "static", "bfloat16"),
    ("llama", "compressed-tensors", "channel", None, "bfloat16"),
])
def test_teacher_forced_agreement(checkpoints, arch, method, strategy, activations, dtype):
    quantized, twin = checkpoints(arch, method, strategy, activations)
    prompts = random_prompts(LENGTHS)
    hf, want = hf_greedy(twin, prompts)
    seqs = [p + t for p, t in zip(prompts, want)]
    llm = LLM(quantized, dtype=dtype, max_model_len=512, kv_cache_memory_bytes=16 << 20, device="cpu")
    layer = next(m for m in llm.engine.executor.model.modules() if isinstance(m, Fp8Linear))
    assert layer.config.activations == activations
    if activations == "static":
        assert layer.input_scale_value > 0
    scored = llm.generate([{"prompt_token_ids": s} for s in seqs], SamplingParams(max_tokens=1, prompt_logprobs=1),
                          use_tqdm=False)
    same, total = agreement_with_transformers(hf, prompts, seqs, scored, FLIP_MARGIN)
    # Every disagreement is asserted a near-tie inside; the count bound catches a drift. On the session-28 AMX
    # host 57 of 59 agreed with the prompts' attention on AVX-512 and 56 on AMX tiles (other sums' order).
    assert same >= 0.9 * total
    assert_all_blocks_free(llm)


def test_activation_scales_are_honoured(checkpoints):
    """Static and dynamic schemes round each input to e4m3 at their scale before the matmul."""
    for activations in ("static", "dynamic", "dynamic_token"):
        quantized, _ = checkpoints("llama", "compressed-tensors", "tensor", activations)
        llm = LLM(quantized, dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20)
        layer = next(m for m in llm.engine.executor.model.modules() if isinstance(m, Fp8Linear))
        x = torch.randn(5, layer.in_features)
        xq = layer.quantize_input(x)
        assert not torch.equal(xq, x)
        scale = torch.tensor(layer.input_scale_value) if activations == "static" else (
            x.abs().amax(-1, keepdim=True) if activations == "dynamic_token" else x.abs().amax()) / 448
        grid = xq / scale  # on e4m3's grid
        torch.testing.assert_close(grid.to(torch.float8_e4m3fn).float(), grid, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("path", ["avx512", "avx2", "torch"])
def test_bf16_input_rounding_takes_each_cpu_path_alike(checkpoints, monkeypatch, path):
    """In bf16 a layer rounds its inputs in C++ (the AVX-512 kernel, or the AVX2 one where AVX-512 is missing),
    else in torch; the three agree to one bf16 rounding. A path the CPU cannot run is skipped."""
    from pagedllm_kernels.cpu import avx2_quantized, build, fp8_linear

    if path == "avx512" and build.kernel_module("fp8_linear") is None:
        pytest.skip("the AVX-512 fp8 kernel cannot run on this CPU")
    if path == "avx2" and build.avx2_module("avx2_quantized") is None:
        pytest.skip("the AVX2 kernels cannot run on this CPU")
    calls = []
    for module, attr, name in ((fp8_linear, "round_input", "avx512"),
                               (avx2_quantized, "fp8_round_input", "avx2")):
        real = getattr(module, attr)
        monkeypatch.setattr(module, attr, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    if path != "avx512":  # what a CPU without AVX-512 sees
        monkeypatch.setattr("pagedllm.models.layers.fp8_linear.kernel_module", lambda name: None)
    if path == "torch":
        monkeypatch.setattr("pagedllm.models.layers.fp8_linear.avx2_module", lambda name: None)
    for activations in ("static", "dynamic", "dynamic_token"):
        quantized, _ = checkpoints("llama", "compressed-tensors", "tensor", activations)
        llm = LLM(quantized, dtype="bfloat16", max_model_len=128, kv_cache_memory_bytes=4 << 20)
        layer = next(m for m in llm.engine.executor.model.modules() if isinstance(m, Fp8Linear))
        x = (torch.randn(7, layer.in_features) * 3).to(torch.bfloat16)
        scale = layer.input_scale_value if activations == "static" else None
        want = fp8_linear.reference_round_input(x, scale, activations == "dynamic_token")
        torch.testing.assert_close(layer.quantize_input(x).float(), want.float(), atol=0, rtol=8e-3)
    assert calls == ([] if path == "torch" else [path] * 3)


def _fp8_tensor_cores() -> bool:
    from pagedllm.models.layers.fp8_linear import fp8_tensor_cores

    return torch.cuda.is_available() and fp8_tensor_cores(torch.device("cuda"))


# The tensor-core path on the GPU where it has them; on the CPU through torch's own (slow, reference) _scaled_mm,
# the layer told the device has them: the same calls, scales and shapes, so the CPU suite tests the path too.
TENSOR_CORE_DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not _fp8_tensor_cores(), reason="needs a GPU with fp8 tensor cores (compute capability 8.9+)")]),
]


@pytest.fixture
def tensor_cores_on(monkeypatch):
    def on(device):
        if device == "cpu":
            monkeypatch.setattr("pagedllm.models.layers.fp8_linear.fp8_tensor_cores", lambda d: True)
    return on


@pytest.mark.parametrize("device", TENSOR_CORE_DEVICES)
@pytest.mark.parametrize("activations", ["static", "dynamic", "dynamic_token"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_on_fp8_tensor_cores_layers_match_the_widening_reference(checkpoints, tensor_cores_on, device, activations,
                                                                dtype):
    """A rounded-activation layer on fp8 tensor cores multiplies e4m3 codes (torch._scaled_mm, the weight kept as
    [N, K]); its output equals the rounded input times the dequantized weight, at any row count."""
    if device == "cpu" and dtype == "float16":
        pytest.skip("the CPU runs no float16 models")
    tensor_cores_on(device)
    quantized, _ = checkpoints("llama", "compressed-tensors", "channel", activations)
    llm = LLM(quantized, dtype=dtype, max_model_len=128, kv_cache_memory_bytes=4 << 20, device=device)
    layers = [m for m in llm.engine.executor.model.modules() if isinstance(m, Fp8Linear)]
    assert layers and all(m.tensor_cores and not hasattr(m, "packed") for m in layers)
    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    for layer in layers[:4]:
        weight = layer.weight_rows.float() * layer.scales[:, None]
        for rows in (1, 7, 64, 300):
            x = (torch.randn(rows, layer.in_features, generator=gen) * 3).to(torch_dtype).to(device)
            got = layer(x)
            assert got.dtype == torch_dtype and got.shape == (rows, layer.out_features)
            want = layer.quantize_input(x).float() @ weight.t()
            tol = {"bfloat16": 8e-3, "float16": 1e-3, "float32": 1e-4}[dtype]
            torch.testing.assert_close(got.float(), want, atol=tol * want.abs().max().item(), rtol=tol)
    assert_all_blocks_free(llm)


def test_a_tensor_core_path_that_disagrees_leaves_the_widening_kernels(checkpoints, tensor_cores_on, monkeypatch,
                                                                       caplog):
    """The load-time probe: a _scaled_mm that is wrong (or refuses the shapes) costs speed, not correctness."""
    tensor_cores_on("cpu")
    real = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: real(*a, **k) * 1.01)
    quantized, twin = checkpoints("llama", "compressed-tensors", "channel", "dynamic_token")
    llm = LLM(quantized, dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20, device="cpu")
    layers = [m for m in llm.engine.executor.model.modules() if isinstance(m, Fp8Linear)]
    assert layers and not any(m.tensor_cores for m in layers) and all(hasattr(m, "packed") for m in layers)
    assert "fp8 tensor cores: off" in caplog.text


@pytest.mark.parametrize("device", TENSOR_CORE_DEVICES)
@pytest.mark.parametrize("method,strategy,activations", [("compressed-tensors", "channel", "dynamic_token"),
                                                         ("fp8", "tensor", "static")])
def test_on_fp8_tensor_cores_teacher_forced_agreement(checkpoints, tensor_cores_on, device, method, strategy,
                                                      activations):
    tensor_cores_on(device)
    quantized, twin = checkpoints("llama", method, strategy, activations)
    prompts = random_prompts(LENGTHS)
    hf, want = hf_greedy(twin, prompts)
    seqs = [p + t for p, t in zip(prompts, want)]
    llm = LLM(quantized, dtype="bfloat16", max_model_len=512, kv_cache_memory_bytes=16 << 20, device=device)
    assert all(m.tensor_cores for m in llm.engine.executor.model.modules() if isinstance(m, Fp8Linear))
    scored = llm.generate([{"prompt_token_ids": s} for s in seqs], SamplingParams(max_tokens=1, prompt_logprobs=1),
                          use_tqdm=False)
    same, total = agreement_with_transformers(hf, prompts, seqs, scored, FLIP_MARGIN)
    # Every disagreement is asserted a near-tie inside; the count bound catches a drift. On the session-28 AMX
    # host 57 of 59 agreed with the prompts' attention on AVX-512 and 56 on AMX tiles (other sums' order).
    assert same >= 0.9 * total
    assert_all_blocks_free(llm)
