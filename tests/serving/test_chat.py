"""Chat through a real tritonserver: the `messages` input rendered with the engine's chat template (here an
engine.json `chat_template` override, since the tiny model's tokenizer has none), equal to `LLM.chat` offline;
malformed conversations refused per request."""

from __future__ import annotations

import json

import numpy as np
import pytest

import triton_server
from pagedllm import LLM, SamplingParams
from serving_client import grpc_call, grpc_inputs, post

pytestmark = pytest.mark.server

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
ENGINE = {"dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": 32 << 20, "max_num_seqs": 8,
          "chat_template": TEMPLATE}
CONVERSATION = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": [{"type": "text", "text": "A loop"}, {"type": "text", "text": "now"}]}]

server = triton_server.server_fixture(ENGINE)


@pytest.fixture(scope="module")
def offline(llama_dir):
    return LLM(llama_dir, **ENGINE)


def _messages(conversation) -> dict:
    return {"messages": (np.array([json.dumps(conversation).encode()], dtype=np.object_), "BYTES")}


def test_streamed_chat_equals_offline_chat(server, offline):
    params = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
    (expected,) = offline.chat(CONVERSATION, SamplingParams(**params), use_tqdm=False)
    assert expected.prompt == "<s>system: You write Python.\n<s>user: A loop\nnow\nassistant:"
    text, err, extra = grpc_call(server, grpc_inputs(None, params, stream=True, **_messages(CONVERSATION),
                                                     return_num_input_tokens=(np.array([True]), "BOOL")),
                                 outputs=["num_input_tokens"])
    assert err is None and text == expected.outputs[0].text
    assert extra["num_input_tokens"] == len(expected.prompt_token_ids)


def test_http_chat_returns_the_reply_without_the_prompt(server, offline):
    params = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
    (expected,) = offline.chat(CONVERSATION, SamplingParams(**params), use_tqdm=False)
    status, body = post(server, "generate", {"messages": json.dumps(CONVERSATION),
                                             "sampling_parameters": json.dumps(params)})
    assert status == 200, body
    assert json.loads(body)["text_output"] == expected.outputs[0].text


@pytest.mark.parametrize("payload, message", [
    ({"messages": json.dumps(CONVERSATION), "text_input": "hi"}, "exactly one is required"),
    ({"messages": "[{\"role\": \"user\""}, "messages: not valid JSON"),
    ({"messages": "[]"}, "messages: must be a non-empty JSON array"),
    ({"messages": json.dumps([{"role": "wizard", "content": "x"}])}, "messages[0].role"),
    ({"messages": json.dumps([{"role": "user", "content": [{"type": "image_url"}]}])}, "only text parts"),
    ({"messages": json.dumps([{"role": "user", "content": "x", "tool_calls": []}])}, "unsupported field"),
])
def test_malformed_conversations_are_refused_clearly(server, payload, message):
    status, body = post(server, "generate", payload)
    assert status == 400 and message in json.loads(body)["error"], body
    # and the server goes on serving
    assert post(server, "generate", {"messages": json.dumps([{"role": "user", "content": "x"}]),
                                     "max_tokens": 2})[0] == 200
