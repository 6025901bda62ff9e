"""Shared fixtures: tiny HF-style model directories made offline, once per test session."""

from __future__ import annotations

import os
import random
import tempfile
import time

import torch

# Without a GPU, Triton kernels run under Triton's interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# GGUF metadata conversions of the session's throwaway files go to a throwaway cache (servers inherit this).
os.environ.setdefault("PAGEDLLM_CACHE_DIR", tempfile.mkdtemp(prefix="pagedllm-test-cache-"))

import psutil
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.tiny_model import make_tiny_model

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """model_dir(arch) -> path of a tiny fp32 model of that family (made on first use)."""
    made: dict[str, str] = {}

    def get(arch: str = "llama", **kwargs) -> str:
        key = arch + repr(sorted(kwargs.items()))
        if key not in made:
            path = str(tmp_path_factory.mktemp(f"model_{arch}"))
            made[key] = make_tiny_model(path, arch=arch, **kwargs)
        return made[key]

    return get


@pytest.fixture(scope="session")
def llama_dir(model_dir):
    return model_dir("llama")


def greedy_outputs_by_backend(model, backends, prompts, max_tokens, **engine_kw) -> list[list]:
    """Per attention backend, a fresh engine's greedy outputs (with the top two logprobs) of the prompts; each
    engine reports the backend it was given and returns every KV block."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    outs = []
    for backend in backends:
        llm = LLM(model, attention_backend=backend, **engine_kw)
        assert llm.get_stats().attention_backend == backend
        outs.append([o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                        use_tqdm=False)])
        assert_all_blocks_free(llm)
    return outs


def parted_at_near_ties(ref_outputs, outputs, max_gap: float = 0.1) -> int:
    """Two engines' greedy outputs of the same requests (each made with logprobs >= 2): where a sequence first
    parts from the reference's, the reference's top two tokens must be within max_gap (a near-tie, which bf16
    rounding in another summation order may flip). Returns how many sequences parted."""
    parted = 0
    for ref, got in zip(ref_outputs, outputs):
        first = next((i for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids)) if a != b), None)
        if first is not None:
            top2 = sorted((lp.logprob for lp in ref.logprobs[first].values()), reverse=True)
            assert top2[0] - top2[1] < max_gap, (first, ref.logprobs[first], got.logprobs[first])
            parted += 1
    return parted


def random_prompts(lengths, vocab=2048, seed=0) -> list[list[int]]:
    """Prompts of random token ids (BOS first, specials excluded)."""
    rng = random.Random(seed)
    return [[0] + [rng.randrange(3, vocab) for _ in range(n - 1)] for n in lengths]


def assert_all_blocks_free(llm) -> None:
    stats = llm.get_stats()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_blocks_free == stats.num_blocks_total, stats
    assert llm.engine.kv.all_free()


class Collector:
    """An EngineLoop output callback that records everything, and each request's final output or error."""

    def __init__(self):
        self.items = []
        self.finished: dict[str, object] = {}

    def __call__(self, rid, out, err):
        self.items.append((rid, out, err))
        if err is not None or out.finished:
            self.finished[rid] = err or out


def wait_for(pred, timeout=60):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def process_running(pid: int) -> bool:
    """Whether a process is still running: a zombie has stopped (only its parent can reap it)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    """Each test carries its folder's name as a marker (tests/kernels/... -> `kernels`), so `pytest -m kernels`
    runs one part; `gpu` tests are skipped where there is no CUDA device."""
    no_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        folder = item.path.parent.name
        if folder != "tests":
            item.add_marker(getattr(pytest.mark, folder))
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)


TINY_VOCAB = 2048  # the tiny models': prompt_logprobs of all of it is each position's whole distribution


def vocab_log_probs(out) -> "torch.Tensor":
    """A request's prompt_logprobs of the whole vocabulary (prompt_logprobs=TINY_VOCAB, the engine's
    max_logprobs as large) as [prompt positions - 1, vocab]: row i predicts prompt token i + 1."""
    import torch

    return torch.tensor([[lp[t].logprob for t in range(TINY_VOCAB)] for lp in out.prompt_logprobs[1:]])


def agreement_with_transformers(hf, prompts, seqs, scored, max_margin: float) -> tuple[int, int]:
    """Teacher-forced: each scored sequence's top token per generated position against transformers' choice
    there (`seqs` are the prompts plus transformers' greedy tokens; `scored` our outputs with prompt_logprobs).
    A disagreement must be a near-tie in transformers' own scores. Returns (agreeing positions, positions)."""
    import torch

    same = total = 0
    for s, p, out in zip(seqs, prompts, scored):
        with torch.no_grad():
            ref = hf(torch.tensor([s])).logits[0].log_softmax(-1)
        for pos in range(len(p), len(s)):
            top = max(out.prompt_logprobs[pos].items(), key=lambda kv: kv[1].logprob)[0]
            total += 1
            if top == s[pos]:
                same += 1
            else:
                assert ref[pos - 1, s[pos]] - ref[pos - 1, top] < max_margin, (pos, top, s[pos])
    return same, total
