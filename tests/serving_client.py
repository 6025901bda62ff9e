"""Calls against a running server that tests share: HTTP generate / generate_stream and one request over a
gRPC stream, returning what came back (errors included) rather than raising."""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request

import numpy as np
import tritonclient.grpc as grpcclient


def post(server, path, payload, timeout: float = 120):
    """(status, body) of a POST to /v2/models/pagedllm/<path>; `payload` a dict (sent as JSON) or raw bytes."""
    data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/pagedllm/{path}", data=data, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def grpc_inputs(prompt, sampling: dict | None = None, stream: bool = False, **extra):
    inputs = []

    def add(name, arr, dtype):
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        inputs.append(t)

    if prompt is not None:
        add("text_input", np.array([prompt.encode() if isinstance(prompt, str) else prompt], dtype=np.object_),
            "BYTES")
    add("stream", np.array([stream]), "BOOL")
    if sampling is not None:
        raw = sampling if isinstance(sampling, (str, bytes)) else json.dumps(sampling)
        add("sampling_parameters", np.array([raw.encode() if isinstance(raw, str) else raw], dtype=np.object_),
            "BYTES")
    for name, (arr, dtype) in extra.items():
        add(name, arr, dtype)
    return inputs


def grpc_call(server, inputs, outputs=()):
    """One request over a gRPC stream: (concatenated text, error or None), plus {name: last value} of the
    named extra outputs when `outputs` is given."""
    got = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    client.async_stream_infer("pagedllm", inputs, enable_empty_final_response=True)
    text, extra = "", {}

    def result(err):
        return (text, err, extra) if outputs else (text, err)

    try:
        while True:
            res, err = got.get(timeout=60)
            if err is not None:
                return result(str(err))
            out = res.as_numpy("text_output")
            if out is not None:
                text += out[0].decode()
            for name in outputs:
                value = res.as_numpy(name)
                if value is not None:
                    extra[name] = value[0].decode() if isinstance(value[0], bytes) else value[0]
            final = res.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                return result(None)
    finally:
        client.stop_stream()
        client.close()
