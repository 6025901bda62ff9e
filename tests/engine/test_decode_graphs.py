"""Decode CUDA graphs (engine/decode_graphs.py): the bucket sizes, where graphs cannot run (said, or refused when
asked for), and the padded static-buffer decode path they replay, run eagerly on the CPU: padding rows change
no real row's logits, and an engine stepping through it makes the same greedy tokens. On a GPU: captured,
checked, and the same tokens as the eager engine."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_all_blocks_free, random_prompts
from pagedllm import LLM, SamplingParams
from pagedllm.engine.decode_graphs import DecodeGraphs, capture_sizes

ENGINE = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 1 << 24, "max_num_seqs": 8}


def test_capture_sizes_follow_vllms_and_stop_at_max_num_seqs():
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert capture_sizes(50)[-3:] == (40, 48, 50)  # a full batch still replays
    assert capture_sizes(6) == (1, 2, 4, 6)
    assert capture_sizes(64, [3, 100, 3]) == (3,)


def _greedy(llm, prompts, lengths):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                          use_tqdm=False)]


def test_the_padded_decode_path_changes_no_real_row(llama_dir):
    """Every pure decode step runs both ways on the same KV state: eagerly as before, and padded to its bucket
    through the static buffers (capture=False). The logits agree, the tokens equal a plain engine's, padding
    happened, and every block returns."""
    prompts = random_prompts([5, 17, 33, 9, 60, 24, 3])
    lengths = [12, 3, 20, 7, 16, 1, 9]  # the batch shrinks: 7, then 6, 5, ... rows (buckets 8, 8, 8, 4 ...)
    expected = _greedy(LLM(llama_dir, **ENGINE), prompts, lengths)

    llm = LLM(llama_dir, **ENGINE)
    runner = llm.engine.executor.worker.runner
    graphs = DecodeGraphs(runner, (1, 2, 4, 8), max_model_len=256)  # never captured: the eager padded path
    eager_step, padded, worst = runner.execute_step, [], [0.0]

    def both(step):
        bucket = graphs.bucket(step)
        eager = eager_step(step)
        if bucket is None:
            return eager
        runner.graphs = graphs
        try:
            replayed = eager_step(step)
        finally:
            runner.graphs = None
        padded.append((len(step.seq_lens), bucket))
        worst[0] = max(worst[0], (replayed - eager).abs().max().item())
        return replayed

    runner.execute_step = both
    assert _greedy(llm, prompts, lengths) == expected
    assert worst[0] < 1e-4, worst
    assert any(n < b for n, b in padded) and {b for _, b in padded} >= {8, 4, 1}, padded
    assert_all_blocks_free(llm)


def test_steps_that_are_not_pure_decodes_run_eagerly(llama_dir):
    llm = LLM(llama_dir, **ENGINE)
    runner = llm.engine.executor.worker.runner
    graphs = DecodeGraphs(runner, (1, 2), max_model_len=256)
    seen = []
    eager_step = runner.execute_step
    runner.execute_step = lambda step: (seen.append((step.num_decodes, len(step.input_ids), graphs.bucket(step))),
                                        eager_step(step))[1]
    _greedy(llm, random_prompts([8, 8, 8]), [3, 3, 3])
    for decodes, tokens, bucket in seen:
        if tokens > decodes:  # a prefill (or chunk) in the step: never a graph
            assert bucket is None
        elif decodes > 2:  # more rows than the largest bucket
            assert bucket is None
        else:
            assert bucket == (1 if decodes == 1 else 2)


def test_where_graphs_cannot_run_the_engine_says_why_and_refuses_sizes(llama_dir):
    stats = LLM(llama_dir, **ENGINE).get_stats()
    assert stats.decode_graphs["sizes"] == [] and stats.decode_graphs["reason"].startswith("device cpu")
    assert LLM(llama_dir, **ENGINE, enforce_eager=True).get_stats().decode_graphs["reason"] == "enforce_eager"
    with pytest.raises(ValueError, match="cuda_graph_sizes: decode CUDA graphs cannot run here: device cpu"):
        LLM(llama_dir, **ENGINE, cuda_graph_sizes=[1, 2])
    with pytest.raises(ValueError, match="cuda_graph_sizes: must be a non-empty list of batch sizes > 0"):
        LLM(llama_dir, **ENGINE, cuda_graph_sizes=[0])
    with pytest.raises(ValueError, match="cuda_graph_sizes: cannot be given with enforce_eager"):
        LLM(llama_dir, **ENGINE, cuda_graph_sizes=[1], enforce_eager=True)
    with pytest.raises(ValueError, match=r"cuda_graph_sizes: a size above max_num_seqs \(8\) would never replay"):
        LLM(llama_dir, **ENGINE, cuda_graph_sizes=[4, 16])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_on_a_gpu_decode_replays_graphs_with_the_eager_tokens(llama_dir):
    """fp32, so that the bucket's larger matmuls cannot flip a near-tie of the random model's logits."""
    gpu = {**ENGINE, "kv_cache_memory_bytes": 1 << 28, "device": "cuda", "attention_backend": "triton"}
    prompts = random_prompts([5, 17, 33, 9, 60, 24, 3])
    lengths = [12, 3, 20, 7, 16, 1, 9]
    eager = LLM(llama_dir, **gpu, enforce_eager=True)
    graphed = LLM(llama_dir, **gpu)
    assert graphed.get_stats().decode_graphs["sizes"] == [1, 2, 4, 8], graphed.get_stats().decode_graphs
    graphs = graphed.engine.executor.worker.runner.graphs
    replays = []
    for b, graph in graphs.graphs.items():
        graph.replay = (lambda inner, b: lambda: (replays.append(b), inner())[1])(graph.replay, b)
    assert _greedy(graphed, prompts, lengths) == _greedy(eager, prompts, lengths)
    assert replays and set(replays) <= {1, 2, 4, 8}
    assert_all_blocks_free(graphed)
