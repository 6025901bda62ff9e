"""The perf scripts' --quick modes run end to end (their figures are for perf/README.md, not asserted)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import process_running

import pagedllm_kernels.cpu as cpu_kernels
from pagedllm_kernels.cpu.build import cpu_supported

PERF = Path(__file__).resolve().parents[2] / "perf"
# Scripts that time our C++ kernels against their torch paths: nothing to compare on a CPU without AVX-512.
needs_kernels = pytest.mark.skipif(not cpu_supported()[0], reason=cpu_supported()[1])


def run(script, *args):
    out = subprocess.run([sys.executable, str(PERF / script), *args], capture_output=True, text=True,
                         timeout=600, cwd=PERF.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("script, args, key", [
    ("throughput.py", ["--quick", "--engines", "pagedllm"], "steady_state_tokens_per_s"),
    ("memory.py", ["--quick"], "concurrency_ratio"),
    ("prefill.py", ["--quick", "--engines", "pagedllm,pagedllm:cpu_decoder_loop=false"], "ratio_to_baseline"),
    ("attention_share.py", ["--quick", "--backends", "torch"], "attention_share"),
    pytest.param("quantized_linear.py", ["--rows", "1,9"], "fp8_over_bf16", marks=needs_kernels),
    ("parallel_sampling.py", ["--quick"], "speedup_median"),
    ("lora.py", ["--quick"], "ratio_median"),
    pytest.param("lora.py", ["--deltas"], "speedup", marks=needs_kernels),
    ("moe.py", ["--quick"], "ratio_pagedllm_over_transformers"),
    ("fallback.py", ["--quick"], "ratio_fallback_over_native"),
    pytest.param("decoder_loop.py", ["--quick"], "ratio_median", marks=needs_kernels),
])
def test_quick_mode_prints_its_ratios(script, args, key):
    records = run(script, *args)
    values = [r[key] for r in records if key in r]
    assert values and all(v > 0 for v in values)


@pytest.mark.server
def test_serving_drives_triton_and_the_openai_front_end():
    records = run("serving.py", "--quick", "--front-ends", "triton,openai", "--stream-interval", "2")
    levels = [r for r in records if "round" in r]
    assert sorted((r["engine"], r["concurrency"]) for r in levels) == [
        ("pagedllm-openai", 1), ("pagedllm-openai", 8), ("pagedllm-triton", 1), ("pagedllm-triton", 8)]
    assert all(r["output_tokens_per_s"] > 0 and r["ttft_p99_ms"] > 0 for r in levels)
    assert {r["stream_interval"] for r in records if r.get("median_over_rounds")} == {2}


@pytest.mark.parametrize("way", ["channel", "http"])
def test_frontend_overhead_measures_the_front_end_per_token(way):
    records = run("frontend_overhead.py", "--quick", "--way", way)
    assert [(r["round"], r["way"]) for r in records if "round" in r] == [(1, way)]
    median = next(r for r in records if r.get("median"))
    assert median["tokens_per_s"] > 0 and median["frontend_us_per_token"] > 0


def test_an_offline_worker_does_not_outlive_its_harness():
    """A harness killed mid-cell (SIGKILL: no clean-up of its own) takes its busy engine worker with it, so no
    engine is left running beside the next benchmark."""
    harness = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import json, sys, time
        sys.path.insert(0, {str(PERF)!r})
        from common import model_dir
        from throughput import MODELS, Worker
        worker = Worker("pagedllm", model_dir(*MODELS["tiny"]), "bfloat16", 1)
        cell = {{"prompts": [[5, 6, 7]], "max_tokens": 32, "repeats": 10**6, "min_seconds": 0, "warmup": False}}
        worker.proc.stdin.write(json.dumps(cell) + "\\n")  # runs until it is stopped
        worker.proc.stdin.flush()
        print(worker.proc.pid, flush=True)
        time.sleep(600)""")], stdout=subprocess.PIPE, text=True, cwd=PERF.parent)
    try:
        worker = int(harness.stdout.readline())
        time.sleep(2)  # well into its cell
        assert process_running(worker)
    finally:
        harness.kill()
        harness.wait()
    deadline = time.monotonic() + 30
    while process_running(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    left_running = process_running(worker)
    if left_running:
        os.kill(worker, signal.SIGKILL)
    assert not left_running


def test_throughput_rounds_give_each_engine_one_run_a_round():
    records = run("throughput.py", "--quick", "--rounds", "3", "--engines", "pagedllm,pagedllm:kv_cache_dtype=fp8")
    cells = [r for r in records if "steady_state_tokens_per_s" in r]
    assert sorted(r["engine"] for r in cells) == ["pagedllm"] * 2 + ["pagedllm:kv_cache_dtype=fp8"] * 2  # 1, 8 seqs
    assert all(len(r["runs_tokens_per_s"]) == 3 and r["warmup_s"] > 0 for r in cells)
    assert [r["ratio_over_pagedllm"] for r in records if "ratio_over_pagedllm" in r][0] > 0


@needs_kernels
def test_attention_share_is_clocked_inside_the_decoder_loop():
    """The C++ decoder loop runs these steps, out of the Python timer's sight (which read 0 ms): its own clock
    gives attention's time there, and its linears' (the rest of the step, other_ms, is what neither takes)."""
    records = run("attention_share.py", "--quick", "--backends", "cpu", "--kv-cache-dtypes", "auto,fp8")
    shares = [r for r in records if r["bench"] == "attention_share"]
    assert {r["kv_cache_dtype"] for r in shares} == {"auto", "fp8"}
    assert all(r["timed_in_decoder_loop"] and 0 < r["attention_share"] < 1 for r in shares)
    assert all(0 < r["linear_ms"] and 0 < r["other_ms"] and r["attention_ms"] + r["linear_ms"] < r["step_ms"]
               for r in shares)


def test_tensor_parallel_traffic_matches_theory():
    """Two all-reduces per layer plus the embedding's, of tokens x hidden each, and one logits all-gather."""
    records = run("tensor_parallel.py", "--quick", "--dtype", "float32")
    comm = [r for r in records if r["bench"] == "tp_comm"]
    assert {r["steps"] for r in comm} == {"prefill or mixed", "decode only"}
    assert all(r["all_reduce_ratio"] == 1.0 and r["all_gather_ratio"] == 1.0 for r in comm)
    assert all(r["all_reduce_calls_per_step"] == 2 * 2 + 1 for r in comm)  # the tiny model has 2 layers
    (tput,) = [r for r in records if r["bench"] == "tp_throughput"]
    assert tput["identical_sequences"] == "8/8"


def another_build(tmp_path, source_name: str) -> str:
    """A copy of one of our C++ CPU kernel sources, a comment appended, so --against builds it as an extension of
    its own: the same code, so the check is that both builds run and report."""
    other = tmp_path / "other.cpp"
    other.write_text((Path(cpu_kernels.__file__).parent / source_name).read_text() + "\n// another build\n")
    return str(other)


def test_bf16_linear_compares_both_paths():
    from pagedllm_kernels.cpu import bf16_tiles

    supported, why = bf16_tiles.cpu_supported()
    if not supported:
        pytest.skip(why)
    records = run("bf16_linear.py", "--rows", "1,600", "--passes", "1")
    assert [r["rows"] for r in records] == [1, 600]
    assert all(r["ours_ms"] > 0 and r["onednn_ms"] > 0 and r["speed_ratio_ours_over_onednn"] > 0 for r in records)
    assert [r["our_kernel_may_take_it"] for r in records] == [1 <= bf16_tiles.MAX_ROWS, 600 <= bf16_tiles.MAX_ROWS]


def test_bf16_linear_against_another_source(tmp_path):
    """--against builds the given quantized_linear.cpp beside ours and alternates the two (here: the same source,
    so the check is that both run and report, on the 0.5B shapes)."""
    from pagedllm_kernels.cpu import bf16_tiles

    supported, why = bf16_tiles.cpu_supported()
    if not supported:
        pytest.skip(why)
    records = run("bf16_linear.py", "--rows", "8", "--passes", "1", "--model", "0.5b",
                  "--against", another_build(tmp_path, "quantized_linear.cpp"))
    assert [(r["model"], r["rows"]) for r in records] == [("0.5b", 8)]
    assert records[0]["ours_ms"] > 0 and records[0]["other_ms"] > 0 and records[0]["speed_ratio_ours_over_other"] > 0


def test_bf16_linear_amx_against_another_source(tmp_path):
    """--kernel amx: our AMX kernel against another build of amx_linear.cpp (the same source: both run and
    report, at one pass and at two passes over each panel pair); against oneDNN it has no prefetch switch."""
    from pagedllm_kernels.cpu import amx_linear

    supported, why = amx_linear.amx_supported()
    if not supported:
        pytest.skip(why)
    records = run("bf16_linear.py", "--kernel", "amx", "--rows", "8,64", "--passes", "1",
                  "--against", another_build(tmp_path, "amx_linear.cpp"))
    assert [r["rows"] for r in records] == [8, 64]
    assert all(r["ours_ms"] > 0 and r["other_ms"] > 0 and r["speed_ratio_ours_over_other"] > 0 for r in records)
    (plain,) = run("bf16_linear.py", "--kernel", "amx", "--rows", "8", "--passes", "1")
    assert plain["onednn_ms"] > 0 and "ours_no_prefetch_ms" not in plain


@needs_kernels
def test_quantized_linear_streams_against_bf16():
    records = run("quantized_linear.py", "--stream", "--rows", "1,9", "--passes", "1")
    assert [(r["model"], r["rows"]) for r in records] == [("125m", 1), ("125m", 9)]
    for r in records:
        assert min(r["int4_ms"], r["fp8_ms"], r["bf16_ms"]) > 0
        assert r["speed_ratio_int4_over_bf16"] > 0 and r["speed_ratio_fp8_over_bf16"] > 0


@needs_kernels
def test_quantized_linear_streams_against_another_source(tmp_path):
    """--stream --against builds the given quantized_linear.cpp's int4 and fp8 linears (one build) and alternates
    them with ours (here: the same source, so the check is that all four run and report)."""
    (record,) = run("quantized_linear.py", "--stream", "--rows", "8", "--passes", "1", "--model", "0.5b",
                    "--against", another_build(tmp_path, "quantized_linear.cpp"))
    assert (record["model"], record["rows"]) == ("0.5b", 8)
    assert min(record[f"{p}_ms"] for p in ("int4", "fp8", "other_int4", "other_fp8")) > 0
    assert "bf16_ms" not in record and record["speed_ratio_int4_over_other_int4"] > 0


def test_avx2_kernels_compare_both_paths():
    from pagedllm_kernels.cpu import avx2_linear

    supported, why = avx2_linear.avx2_supported()
    if not supported:
        pytest.skip(why)
    records = run("avx2_kernels.py", "--rows", "1,9", "--quantized-rows", "1,9", "--contexts", "2x40", "--passes", "1")
    assert [(r["bench"], r.get("rows"), r.get("kv_dtype")) for r in records] == [
        ("avx2_linear", 1, None), ("avx2_linear", 9, None), ("avx2_quantized_linear", 1, None),
        ("avx2_quantized_linear", 9, None), ("avx2_decode_attention", 2, "bf16"), ("avx2_decode_attention", 2, "fp8")]
    assert all(r["speed_ratio_ours_over_torch"] > 0 for r in records if "speed_ratio_ours_over_torch" in r)
    for r in records[2:4]:
        assert {k for k in r if k.startswith("speed_")} == {
            "speed_int4_over_bf16", "speed_int4_via_bf16_tiles_over_bf16", "speed_fp8_over_bf16",
            "speed_fp8_via_bf16_tiles_over_bf16"}
        assert all(v > 0 for k, v in r.items() if k.startswith("speed_"))


@needs_kernels
def test_decode_attention_against_another_source(tmp_path):
    """--against builds the given paged_attention.cpp beside ours (perf/common.build_kernel_source, declared by
    ops.h) and alternates the two: here the same source, so both run and report."""
    records = run("decode_attention.py", "--shapes", "2x40", "--passes", "1",
                  "--against", another_build(tmp_path, "paged_attention.cpp"))
    assert [(r["rows"], r["max_context"]) for r in records[1:]] == [(2, 40)]
    assert records[1]["ours_ms"] > 0 and records[1]["other_ms"] > 0


@needs_kernels
def test_prompt_attention_against_another_version(tmp_path):
    """--against takes a directory holding another version of the kernels' sources, built against its own
    headers: here a copy of ours, so both run, report and agree exactly, on both query-head groupings."""
    other = tmp_path / "cpu"
    other.mkdir()
    for source in Path(cpu_kernels.__file__).parent.iterdir():
        if source.suffix in (".cpp", ".h"):
            (other / source.name).write_text(source.read_text() + "\n// another build\n")
    records = run("prompt_attention.py", "--shapes", "12/4x40,14/2x33", "--passes", "1", "--against", str(other))
    assert [(r["heads"], r["kv_heads"], r["tokens"]) for r in records] == [(12, 4, 40), (14, 2, 33)]
    assert all(r["ours_ms"] > 0 and r["other_ms"] > 0 and r["max_abs_diff"] == 0 for r in records)


@needs_kernels
def test_prompt_attention_on_cold_caches():
    (record,) = run("prompt_attention.py", "--shapes", "12/4x70", "--prompts", "3", "--passes", "1", "--cold")
    assert record["cold"] and record["prompts"] == 3 and record["ours_tflop_per_s"] > 0


@needs_kernels
def test_decode_attention_reports_bandwidth():
    records = run("decode_attention.py", "--shapes", "2x40,3x100", "--passes", "1")
    assert records[0]["bench"] == "read_bandwidth" and records[0]["gb_per_s"] > 0
    assert [(r["rows"], r["max_context"]) for r in records[1:]] == [(2, 40), (3, 100)]
    assert all(r["ours_ms"] > 0 and 0 < r["ours_share_of_read_bandwidth"] for r in records[1:])


def test_preemption_waste_counts_recomputed_prefills():
    records = run("preemption_waste.py", "--kv-gib", "0.0625", "--outputs", "128", "--seqs", "16")
    by_policy = {r["policy"]: r for r in records if "policy" in r}
    assert by_policy["max_utilization"]["preemptions"] > 0
    assert by_policy["max_utilization"]["computed_over_needed"] > 1
    assert by_policy["guaranteed_no_evict"]["preemptions"] == 0
    assert by_policy["guaranteed_no_evict"]["tokens_computed"] == by_policy["guaranteed_no_evict"]["tokens_needed"]
