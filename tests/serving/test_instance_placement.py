"""Instance placement: a KIND_GPU instance runs its engine on the GPU Triton placed it on (and a
tensor-parallel one on the devices after it), KIND_CPU on the CPU, KIND_MODEL where engine.json says; an
engine.json device that contradicts Triton's placement fails the load with a message naming both. The CPU
kinds are shown through the real tritonserver; KIND_GPU needs a device, so its rule is tested directly."""

from __future__ import annotations

import json

import pytest
from serving_client import post
from triton_server import Server

from pagedllm.net import free_ports
from pagedllm.serving import launcher
from pagedllm.serving.placement import instance_device


def test_a_gpu_instance_runs_on_its_device():
    assert instance_device("GPU", "1", "auto") == "cuda:1"
    assert instance_device("GPU", 1, "cuda") == "cuda:1"
    assert instance_device("GPU", "1", "cuda:1") == "cuda:1"
    with pytest.raises(ValueError, match=r"engine.json says 'cuda:0', but Triton placed .* on cuda:1"):
        instance_device("GPU", "1", "cuda:0")
    with pytest.raises(ValueError, match="placed this KIND_GPU instance"):
        instance_device("GPU", "0", "cpu")
    assert instance_device("CPU", "0", "auto") == "cpu"
    assert instance_device("MODEL", "0", "cuda:3") == "cuda:3"  # KIND_MODEL: engine.json decides


def _serve_as(tmp_path, kind: str, engine: dict, llama_dir):
    repo = launcher.prepare_model_repository(tmp_path / "repo", llama_dir, engine)
    config = repo / "pagedllm" / "config.pbtxt"
    text = config.read_text()
    assert "instance_group [ { count: 1, kind: KIND_MODEL } ]" in text
    config.write_text(text.replace("kind: KIND_MODEL", f"kind: {kind}"))
    ports = free_ports(3)
    log = tmp_path / "tritonserver.log"
    proc = launcher.start_server(repo, launcher.prepare_backends(tmp_path / "backends"), *ports, log_path=log)
    return Server(proc, *ports, log)


@pytest.mark.server
def test_a_cpu_instance_serves_on_the_cpu_and_refuses_a_gpu_device(tmp_path, llama_dir):
    server = _serve_as(tmp_path / "ok", "KIND_CPU", {"max_model_len": 256}, llama_dir)
    try:
        launcher.wait_ready(server.http, server.proc, model="pagedllm")
        status, body = post(server, "generate", {"text_input": "hello",
                                                 "sampling_parameters": json.dumps({"max_tokens": 4})})
        assert status == 200, body
    finally:
        launcher.stop_server(server.proc)
    assert "on cpu" in server.log.read_text()

    bad = _serve_as(tmp_path / "bad", "KIND_CPU", {"max_model_len": 256, "device": "cuda:0"}, llama_dir)
    try:
        with pytest.raises(RuntimeError):
            launcher.wait_ready(bad.http, bad.proc, timeout=120, model="pagedllm")
    finally:
        launcher.stop_server(bad.proc)
    assert "engine.json says 'cuda:0', but this is a KIND_CPU instance" in bad.log.read_text()
