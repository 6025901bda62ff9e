"""Multi-LoRA through the real tritonserver: adapters declared in engine.json (lora_modules) and in a
multi_lora.json beside it, named per request in both contracts (vllm_backend's `lora_name` in
sampling_parameters, TensorRT-LLM's `lora_task_id`) and through the OpenAI front end (`model` =
`pagedllm_lora_<name>`); concurrent requests for three adapters and the base model with two slots each get
their own model's text; unknown adapters and weights sent with a request are refused per request; the
`pagedllm:lora_requests_info` gauge names the running adapters."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import openai
import pytest
import triton_server
from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.net import free_port
from pagedllm.serving import launcher
from pagedllm.tiny_model import make_lora_adapter
from serving_client import grpc_call, grpc_inputs

pytestmark = pytest.mark.server

ENGINE = {"dtype": "float32", "max_model_len": 1024, "kv_cache_memory_bytes": 32 << 20, "enable_lora": True,
          "max_loras": 2, "max_lora_rank": 16}
PROMPTS = ["def main():", "import os\n", "class Stack:", "x = [i for i"]
TOKENS = 12


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_lora_adapter(llama_dir, str(root / name), rank=r, seed=s)
            for name, r, s in (("alpha", 8, 1), ("beta", 16, 2), ("gamma", 8, 3))}


@pytest.fixture(scope="module")
def server(llama_dir, adapters, tmp_path_factory):
    engine = {**ENGINE, "lora_modules": {"alpha": adapters["alpha"]}}  # id 1
    multi = json.dumps({"beta": adapters["beta"], "gamma": adapters["gamma"]})  # ids 2, 3
    run = launcher.launch_on_free_ports(tmp_path_factory.mktemp("triton"), llama_dir, engine,
                                        version_files={"multi_lora.json": multi})
    s = triton_server.Server(run.proc, run.http_port, run.grpc_port, run.metrics_port, run.log)
    yield s
    triton_server.stop(s)


@pytest.fixture(scope="module")
def expected(llama_dir, adapters):
    """{adapter name or None: [greedy text of each prompt]} from the offline engine."""
    llm = LLM(llama_dir, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=16 << 20, enable_lora=True,
              max_loras=3)
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    out = {}
    for i, name in enumerate([None, "alpha", "beta", "gamma"]):
        lora = LoRARequest(name, i, adapters[name]) if name else None
        out[name] = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False, lora_request=lora)]
    assert len({tuple(v) for v in out.values()}) == 4  # every adapter changes the text
    return out


def sampling(**extra) -> dict:
    return {"temperature": 0, "max_tokens": TOKENS, "ignore_eos": True, **extra}


def by_name(server, prompt, name):
    return grpc_call(server, grpc_inputs(prompt, sampling(**({"lora_name": name} if name else {})),
                                         exclude_input_in_output=(np.array([True]), "BOOL")))


def by_task_id(server, prompt, task_id, **extra):
    tensors = {"exclude_input_in_output": (np.array([True]), "BOOL"),
               "lora_task_id": (np.array([task_id], dtype=np.uint64), "UINT64"), **extra}
    return grpc_call(server, grpc_inputs(prompt, sampling(), **tensors))


def test_lora_name_and_task_id_run_their_adapters(server, expected):
    for name, task_id in (("alpha", 1), ("beta", 2), ("gamma", 3)):
        for i, prompt in enumerate(PROMPTS[:2]):
            assert by_name(server, prompt, name) == (expected[name][i], None)
            assert by_task_id(server, prompt, task_id) == (expected[name][i], None)


def test_concurrent_mix_of_adapters_and_base_with_two_slots(server, expected):
    jobs = [(p, name) for name in (None, "alpha", "beta", "gamma") for p in PROMPTS] * 2
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = list(pool.map(lambda job: by_name(server, *job), jobs))
    for (prompt, name), (text, err) in zip(jobs, results):
        assert err is None and text == expected[name][PROMPTS.index(prompt)], (prompt, name, err)
    assert server.wait_metrics(server.all_blocks_free)


def test_unknown_adapters_and_sent_weights_are_refused_per_request(server, expected):
    text, err = by_name(server, PROMPTS[0], "delta")
    assert "lora_name: unknown adapter 'delta'" in err and "alpha, beta, gamma" in err
    text, err = by_task_id(server, PROMPTS[0], 9)
    assert "lora_task_id: unknown adapter id 9" in err
    weights = {"lora_weights": (np.zeros((1, 8), np.float16), "FP16"),
               "lora_config": (np.zeros((1, 3), np.int32), "INT32")}
    text, err = by_task_id(server, PROMPTS[0], 1, **weights)
    assert "lora_weights: adapters are not sent with requests" in err
    assert by_name(server, PROMPTS[0], "alpha") == (expected["alpha"][0], None)  # the server carries on


def test_lora_requests_info_names_running_adapters(server):
    done = threading.Event()

    def long_beta():
        grpc_call(server, grpc_inputs(PROMPTS[0], {"max_tokens": 400, "ignore_eos": True, "lora_name": "beta"}))
        done.set()

    threading.Thread(target=long_beta, daemon=True).start()
    def current(m):  # vLLM's reading: the series updated last
        series = {k: v for k, v in m.items() if k.startswith("pagedllm:lora_requests_info")}
        return max(series, key=series.get) if series else None

    key = 'pagedllm:lora_requests_info{max_lora="2",running_lora_adapters="beta",waiting_lora_adapters=""}'
    m = server.wait_metrics(lambda m: current(m) == key)
    assert current(m) == key and m[key] > 1.7e9  # the value is the time the labels were last current
    assert done.wait(120)
    idle = 'pagedllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""}'
    m = server.wait_metrics(lambda m: current(m) == idle)
    assert current(m) == idle and m[idle] > m[key]


def test_openai_model_names_the_adapter(server, expected):
    port = free_port()
    proc = launcher.start_openai_frontend("127.0.0.1", port, server.http_url, 10)
    try:
        launcher.wait_openai_ready(f"http://127.0.0.1:{port}", proc)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        for name in ("beta", None):
            out = client.completions.create(model="pagedllm" + (f"_lora_{name}" if name else ""),
                                            prompt=PROMPTS[1], max_tokens=TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True})
            assert out.choices[0].text == expected[name][1]
            assert out.model == "pagedllm" + (f"_lora_{name}" if name else "")
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model="pagedllm_lora_nope", prompt="x", max_tokens=2)
        assert e.value.body["code"] == "model_not_found" and "nope" in e.value.body["message"]
    finally:
        launcher.stop_process(proc)
