"""Tensor parallelism on CPU over gloo: TP=2 is token-identical to TP=1 (fp32), a dead worker fails requests
cleanly, and through Triton a TP model streams and leaves no worker behind when unloaded."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import triton_server
from conftest import Collector, assert_all_blocks_free, process_running, random_prompts, wait_for
from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.engine.executor.multiproc import WorkerFailedError
from pagedllm.distributed.tensor_parallel import check_shardable, kv_heads_for_rank
from pagedllm.serving.engine_loop import EngineDeadError, EngineLoop
from pagedllm_client import PagedLLMClient

BLOCKS = 40  # per rank, in both runs: small enough that this workload preempts
PREFIX = random_prompts([64], seed=7)[0]


def _workload():
    prompts = random_prompts([1, 7, 16, 33, 64, 100, 150, 300], seed=3)
    prompts += [PREFIX + p[1:] for p in random_prompts([5, 20, 40, 60], seed=4)]  # shared 64-token prefix
    # Top-2 logprobs too: greedy tokens of a tiny random model can survive a wrong attention head; logits not.
    params = [SamplingParams(temperature=0, max_tokens=8 + 9 * i, ignore_eos=True, logprobs=2)
              for i in range(len(prompts))]
    return prompts, params


def _kv_budget(model: str, tp: int) -> int:
    """Bytes per rank that hold BLOCKS blocks (tiny model: 2 layers, head_dim 32, fp32)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model)
    kv_heads = kv_heads_for_rank(cfg.num_attention_heads, cfg.num_key_value_heads, 0, tp)[1]
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return BLOCKS * 2 * cfg.num_hidden_layers * 16 * kv_heads * head_dim * 4


def _generate(model: str, tp: int):
    llm = LLM(model, dtype="float32", tensor_parallel_size=tp, kv_cache_memory_bytes=_kv_budget(model, tp),
              max_model_len=512, max_num_seqs=6, max_num_batched_tokens=256)
    try:
        prompts, params = _workload()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert_all_blocks_free(llm)
        tokens = [o.outputs[0].token_ids for o in outs]
        logprobs = [v for o in outs for pos in o.outputs[0].logprobs
                    for v in sorted(x.logprob for x in pos.values())]
        return tokens, logprobs, llm.get_stats()
    finally:
        llm.shutdown()


def test_kv_heads_split_or_replicated():
    assert [kv_heads_for_rank(8, 4, r, 2) for r in range(2)] == [(0, 2), (2, 2)]
    # 2 KV heads over 4 ranks: ranks 0-1 read KV head 0, ranks 2-3 KV head 1.
    assert [kv_heads_for_rank(8, 2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [kv_heads_for_rank(4, 1, r, 2) for r in range(2)] == [(0, 1), (0, 1)]


def test_unshardable_sizes_are_refused_before_any_process_starts(llama_dir):
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide num_attention_heads=4"):
        check_shardable(AutoConfig.from_pretrained(llama_dir), 3)
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not divide"):
        LLM(llama_dir, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        LLM(llama_dir, pipeline_parallel_size=2)


@pytest.mark.parametrize("arch,kv_heads,tp", [
    ("llama", None, 2), ("mistral", None, 2), ("qwen2", None, 2), ("qwen3", None, 2),
    ("llama", 1, 2),  # one KV head, replicated on both ranks
    ("qwen2", None, 4),  # 2 KV heads over 4 ranks: ranks 0-1 hold head 0, ranks 2-3 head 1
], ids=["llama", "mistral", "qwen2", "qwen3", "llama-mqa", "qwen2-tp4"])
def test_tp_is_token_identical_to_tp1_under_preemption_and_prefix_caching(model_dir, arch, kv_heads, tp):
    model = model_dir(arch, num_key_value_heads=kv_heads) if kv_heads else model_dir(arch)
    ref, ref_logprobs, ref_stats = _generate(model, 1)
    got, logprobs, stats = _generate(model, tp)
    assert got == ref
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-3)
    for s in (ref_stats, stats):
        assert s.num_blocks_total == BLOCKS - 1
        assert s.num_preemptions > 0 and s.prefix_cache_hits > 0, s


def test_forked_samples_and_beams_copy_their_blocks_on_every_rank(llama_dir):
    """Copy-on-write block copies travel in the step's inputs: each rank copies its own shard of the block."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts([21, 37], seed=12)]
    sampled = SamplingParams(n=3, seed=4, temperature=1.0, max_tokens=20, ignore_eos=True)
    beams = BeamSearchParams(beam_width=3, max_tokens=16, ignore_eos=True)
    results = []
    for tp in (1, 2):
        llm = LLM(llama_dir, dtype="float32", tensor_parallel_size=tp, max_model_len=256,
                  kv_cache_memory_bytes=1 << 22)
        try:
            outs = llm.generate(prompts, sampled, use_tqdm=False) + llm.beam_search(prompts, beams)
            results.append([[c.token_ids for c in o.outputs] for o in outs])
            assert_all_blocks_free(llm)
        finally:
            llm.shutdown()
    assert results[0] == results[1]


def _worker(llm):
    (proc,) = llm.engine.executor.procs.values()
    return proc


def test_a_killed_worker_fails_in_flight_requests_and_the_engine_reports_unhealthy(llama_dir):
    llm = LLM(llama_dir, dtype="float32", tensor_parallel_size=2, max_model_len=512,
              kv_cache_memory_bytes=8 << 20)
    try:
        worker = _worker(llm)
        c, dead = Collector(), []
        # on_dead takes over the recovery (returns True): the loop stays down
        loop = EngineLoop(lambda: None, c, on_dead=lambda e: dead.append(e) or True, engine=llm.engine)
        for i in range(3):
            loop.submit(str(i), llm.engine.input_processor.process([0, 5 + i, 6], SamplingParams(max_tokens=400, ignore_eos=True)))
        wait_for(lambda: len(c.items) >= 6)  # all three are decoding
        os.kill(worker.pid, signal.SIGKILL)
        wait_for(lambda: len(c.finished) == 3, timeout=30)
        for err in c.finished.values():
            assert isinstance(err, EngineDeadError)
            assert f"rank 1 (pid {worker.pid}) killed by signal SIGKILL" in str(err)
        assert not llm.engine.healthy and not loop.healthy and len(dead) == 1
        with pytest.raises(RuntimeError, match="engine is not healthy: tensor-parallel worker died"):
            llm.engine.add_request([0, 1, 2])
    finally:
        llm.shutdown()
    assert worker.poll() is not None and not llm.engine.executor.procs


def test_offline_generate_raises_and_releases_its_blocks_when_a_worker_dies(llama_dir):
    llm = LLM(llama_dir, dtype="float32", tensor_parallel_size=2, max_model_len=512,
              kv_cache_memory_bytes=8 << 20)
    try:
        worker = _worker(llm)
        killer = threading.Timer(1.0, os.kill, (worker.pid, signal.SIGKILL))
        killer.start()
        params = SamplingParams(max_tokens=500, ignore_eos=True)
        with pytest.raises(WorkerFailedError, match="rank 1"):
            llm.generate([[0, 5 + i] for i in range(4)], params, use_tqdm=False)
        killer.join()
        assert_all_blocks_free(llm)
        with pytest.raises(RuntimeError, match="not healthy"):
            llm.generate([[0, 5]], params, use_tqdm=False)
    finally:
        llm.shutdown()


def _worker_pids_under(server_pid: int) -> list[int]:
    """pids of pagedllm workers whose parent (the Python stub) is a child of the tritonserver process."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"pagedllm.engine.executor.worker_main" not in f.read():
                    continue
            if _ppid(_ppid(int(entry))) == server_pid:
                found.append(int(entry))
        except OSError:  # exited meanwhile
            continue
    return found


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


@pytest.mark.server
def test_tp2_model_through_triton_streams_and_unload_leaves_no_worker(llama_dir, tmp_path):
    expected = LLM(llama_dir, dtype="float32").generate(
        "def main():", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    engine = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 8 << 20,
              "tensor_parallel_size": 2}
    server = triton_server.start(tmp_path, llama_dir, engine)
    try:
        workers = _worker_pids_under(server.proc.pid)
        assert len(workers) == 1
        pieces = []
        result = PagedLLMClient(server.grpc_url).generate("def main():", max_tokens=24, temperature=0,
                                                          ignore_eos=True, on_piece=pieces.append)
        assert result.text == expected.outputs[0].text and len(pieces) > 1
        import tritonclient.http as httpclient

        http = httpclient.InferenceServerClient(server.http_url)
        http.unload_model("pagedllm")
        deadline = time.monotonic() + 60
        while any(process_running(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(process_running(p) for p in workers), "a worker outlived its model"
        assert _worker_pids_under(server.proc.pid) == []
        http.close()
    finally:
        triton_server.stop(server)


def test_torchrun_launch_runs_the_engine_on_rank_0_and_serves_it_from_rank_1(llama_dir, tmp_path):
    import json
    import subprocess
    import sys

    args = ["generate", "def main():", "x = 1", "--model", llama_dir, "--dtype", "float32", "--max-tokens", "12",
            "--device", "cpu"]
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    run = subprocess.run([torchrun, "--nproc-per-node", "2", "-m", "pagedllm.cli", *args,
                          "--tensor-parallel-size", "2"], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    single = subprocess.run([sys.executable, "-m", "pagedllm.cli", *args], capture_output=True, text=True,
                            timeout=300, check=True)
    lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == 2 and lines == [json.loads(x) for x in single.stdout.splitlines() if x.startswith("{")]
    assert "rank1 INFO stopped" in run.stderr  # rank 1 served steps until rank 0 told it to stop


def test_fp8_kv_scales_computed_at_load_on_every_rank(llama_dir):
    """Every rank runs the calibration prefill (its collectives need them all) and scales its own KV heads:
    rank 0's scales are at most the whole model's (its heads are a subset), and the engine then serves."""
    kw = dict(dtype="bfloat16", max_model_len=1024, kv_cache_memory_bytes=8 << 20, kv_cache_dtype="fp8",
              calculate_kv_scales=True)
    whole = [layer.self_attn.kv_scales for layer in LLM(llama_dir, **kw).engine.executor.model.model.layers]
    llm = LLM(llama_dir, tensor_parallel_size=2, **kw)
    try:
        shard = [layer.self_attn.kv_scales for layer in llm.engine.executor.model.model.layers]
        for s, w in zip(shard, whole):
            assert 0 < s.k <= 1.05 * w.k and 0 < s.v <= 1.05 * w.v and (s.k, s.v) != (1.0, 1.0)
        out = llm.generate([{"prompt_token_ids": p} for p in random_prompts([5, 40], seed=3)],
                           SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in out] == [8, 8]
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()
