"""Prometheus metrics through Triton's metrics port (real server): exact counters and histogram counts
after a known set of requests, gauges under load, prefix-cache hits, and metrics switched off."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

import triton_server
from pagedllm import LLM, SamplingParams
from pagedllm_client import PagedLLMClient
from pagedllm_client.client import ServerError
from serving_client import grpc_call, grpc_inputs

pytestmark = pytest.mark.server

ENGINE = {"dtype": "float32", "max_model_len": 2048, "kv_cache_memory_bytes": 64 << 20}


server = triton_server.server_fixture(ENGINE)


def test_exact_counts_after_a_known_set_of_requests(server, llama_dir):
    offline = LLM(llama_dir, **{**ENGINE, "kv_cache_memory_bytes": 16 << 20})
    tok = offline.get_tokenizer()
    prompts = ["def a():", "import b", "class C:", "x = 1", "y = 2"]
    # 3 finished by length (8 tokens each)
    for p in prompts[:3]:
        assert PagedLLMClient(server.grpc_url).generate(p, max_tokens=8, ignore_eos=True).num_output_tokens == 8
    # 2 finished by a stop string taken from their own greedy text
    stopped_tokens = 0
    for p in prompts[3:]:
        full = offline.generate(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0].text
        r = PagedLLMClient(server.grpc_url).generate(p, max_tokens=20, ignore_eos=True, temperature=0,
                                                    stop=[full[5:8]])
        assert r.finish_reason == "stop"
        stopped_tokens += r.num_output_tokens
    # 1 cancelled by its client mid-stream
    stream = PagedLLMClient(server.grpc_url).stream("while True:", max_tokens=1500, ignore_eos=True)
    next(stream)
    stream.close()
    # 1 rejected
    with pytest.raises(ServerError):
        PagedLLMClient(server.grpc_url).generate("z", max_tokens=0)

    # A scrape can fall between a publish's counters and its histogram observations (one call each): wait for
    # both (CI once read 4 of the 6 end-to-end latencies with the counters complete).
    histograms = ("e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
                  "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens",
                  "time_to_first_token_seconds")
    m = server.wait_metrics(lambda m: m.get('pagedllm:request_success_total{finished_reason="abort"}') == 1
                            and server.all_blocks_free(m)
                            and all(m.get(f"pagedllm:{h}_count") == 6 for h in histograms)
                            and m.get("pagedllm:inter_token_latency_seconds_count")
                            == m.get("pagedllm:generation_tokens_total", 0) - 6)
    assert m['pagedllm:request_success_total{finished_reason="length"}'] == 3
    assert m['pagedllm:request_success_total{finished_reason="stop"}'] == 2
    assert m['pagedllm:request_success_total{finished_reason="abort"}'] == 1
    assert m['pagedllm:request_success_total{finished_reason="timeout"}'] == 0
    assert m["pagedllm:requests_cancelled_total"] == 1
    assert m["pagedllm:requests_rejected_total"] == 1
    assert m["pagedllm:requests_timed_out_total"] == 0
    assert m["pagedllm:num_preemptions_total"] == 0
    for h in histograms:
        assert m[f"pagedllm:{h}_count"] == 6, h  # every request that reached the engine
    prompt_lens = sum(len(tok.encode(p)) for p in prompts + ["while True:"])
    assert m["pagedllm:request_prompt_tokens_sum"] == prompt_lens
    assert m["pagedllm:prompt_tokens_total"] == prompt_lens  # distinct short prompts: no prefix hits
    generated = m["pagedllm:generation_tokens_total"]
    assert m["pagedllm:request_generation_tokens_sum"] == generated
    cancelled_tokens = generated - 3 * 8 - stopped_tokens
    assert 1 <= cancelled_tokens < 1500
    assert m["pagedllm:inter_token_latency_seconds_count"] == generated - 6  # all tokens but each first
    # The inter-token latency is binned by us (binned_histogram.py): its buckets print as a native histogram's
    # of the same bounds (the time to first token's), cumulative, +Inf equal to the count.
    def buckets(name):  # {bound as printed: count}, in the order of the bounds
        found = {k.split('le="')[1][:-2]: v for k, v in m.items() if k.startswith(f"pagedllm:{name}_bucket")}
        return dict(sorted(found.items(), key=lambda kv: float(kv[0])))

    itl = buckets("inter_token_latency_seconds")
    assert list(itl) == list(buckets("time_to_first_token_seconds")) and list(itl)[-1] == "+Inf"
    assert list(itl.values()) == sorted(itl.values()) and itl["+Inf"] == generated - 6
    assert 0 < m["pagedllm:inter_token_latency_seconds_sum"] < 60
    assert m["pagedllm:iteration_tokens_sum"] == prompt_lens + generated - 6  # every computed token
    assert m['pagedllm:time_to_first_token_seconds_bucket{le="+Inf"}'] == 6
    assert m["pagedllm:num_requests_running"] == 0 and m["pagedllm:num_requests_waiting"] == 0
    assert m["pagedllm:kv_cache_usage_perc"] == 0


def test_gauges_rise_under_sixteen_streams(server):
    peak = {"running": 0.0, "usage": 0.0}
    threads = [threading.Thread(target=lambda i=i: PagedLLMClient(server.grpc_url).generate(
        f"def f{i}():", max_tokens=150, ignore_eos=True)) for i in range(16)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        m = server.scrape()
        peak["running"] = max(peak["running"], m["pagedllm:num_requests_running"])
        peak["usage"] = max(peak["usage"], m["pagedllm:kv_cache_usage_perc"])
    for t in threads:
        t.join()
    assert peak["running"] > 1 and peak["usage"] > 0
    assert server.all_blocks_free(server.wait_metrics(server.all_blocks_free))


def test_shared_prefix_pair_moves_prefix_cache_hits(server):
    before = server.scrape()["pagedllm:prefix_cache_hits_total"]
    system = "You are a careful assistant. " * 12  # several full blocks
    for q in ("What is 2+2?", "Name a color."):
        PagedLLMClient(server.grpc_url).generate(system + q, max_tokens=4, temperature=0)
    m = server.wait_metrics(lambda m: m["pagedllm:prefix_cache_hits_total"] > before)
    assert m["pagedllm:prefix_cache_hits_total"] - before >= 16


def test_metrics_off_exports_none_of_ours(llama_dir, tmp_path):
    off = 'parameters { key: "enable_metrics", value: { string_value: "false" } }\n'
    s = triton_server.start(tmp_path, llama_dir, ENGINE, config_overrides=off)
    try:
        text, err = grpc_call(s, grpc_inputs("def f():", json.dumps({"max_tokens": 5}), stream=True,
                                              ignore_eos=(np.array([True]), "BOOL")))
        assert err is None and text
        assert s.scrape() == {}
    finally:
        triton_server.stop(s)


def test_dashboard_uses_only_exported_metrics(server):
    import re
    from pathlib import Path

    dash = json.loads((Path(__file__).parents[2] / "docs" / "grafana" / "pagedllm.json").read_text())
    used = {re.sub(r"_bucket$", "", name) for p in dash["panels"] for t in p["targets"]
            for name in re.findall(r"pagedllm:[a-z0-9_]+", t["expr"])}
    exported = {re.sub(r"_(count|sum|bucket)$", "", k.split("{")[0]) for k in server.scrape()}
    assert used and used <= exported, used - exported
