"""Streaming generation over gRPC (bidirectional stream) or HTTP (generate / generate_stream, SSE)."""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np


@dataclass
class GenerateResult:
    text: str = ""
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int = 0
    chunks: list[str] = field(default_factory=list)


class ServerError(RuntimeError):
    pass


def _sampling_json(params: dict) -> str:
    return json.dumps({k: v for k, v in params.items() if v is not None})


class PagedLLMClient:
    def __init__(self, url: str = "127.0.0.1:8001", protocol: str = "grpc", model: str = "pagedllm") -> None:
        if protocol not in ("grpc", "http"):
            raise ValueError("protocol must be 'grpc' or 'http'")
        self.url, self.protocol, self.model = url, protocol, model

    # --- gRPC -----------------------------------------------------------------------------------
    def stream(self, prompt: str, **sampling) -> Iterator[str]:
        """Yields text pieces as the server produces them; raises ServerError on an error response."""
        result = GenerateResult()
        yield from (self._grpc_stream if self.protocol == "grpc" else self._http_stream)(prompt, sampling, result)

    def generate(self, prompt: str, stream: bool = True, on_piece=None, **sampling) -> GenerateResult:
        """Whole result; with stream=True it is collected from the stream (on_piece(i) sees each piece)."""
        result = GenerateResult()
        if not stream and self.protocol == "http":
            return self._http_generate(prompt, sampling)
        gen = self._grpc_stream if self.protocol == "grpc" else self._http_stream
        for piece in gen(prompt, sampling, result):
            if on_piece is not None:
                on_piece(len(result.chunks))
            result.chunks.append(piece)
        result.text = "".join(result.chunks)
        return result

    def _grpc_stream(self, prompt: str, sampling: dict, result: GenerateResult) -> Iterator[str]:
        import tritonclient.grpc as grpcclient

        inputs = []

        def add(name, value, dtype):
            arr = np.array([value], dtype=np.object_ if dtype == "BYTES" else None)
            if dtype == "BOOL":
                arr = np.array([value], dtype=bool)
            t = grpcclient.InferInput(name, [1], dtype)
            t.set_data_from_numpy(arr)
            inputs.append(t)

        add("text_input", prompt.encode(), "BYTES")
        add("stream", True, "BOOL")
        add("exclude_input_in_output", True, "BOOL")
        add("sampling_parameters", _sampling_json(sampling).encode(), "BYTES")
        add("return_finish_reason", True, "BOOL")
        add("return_num_output_tokens", True, "BOOL")
        add("return_num_input_tokens", True, "BOOL")
        responses: queue.Queue = queue.Queue()
        client = grpcclient.InferenceServerClient(self.url)
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        finished = False
        try:
            client.async_stream_infer(self.model, inputs, enable_empty_final_response=True)
            while True:
                res, err = responses.get(timeout=600)
                if err is not None:
                    raise ServerError(str(err))
                final = res.get_response().parameters.get("triton_final_response")
                text = res.as_numpy("text_output")
                if text is not None:
                    piece = text[0].decode()
                    reason = res.as_numpy("finish_reason")
                    if reason is not None and reason[0]:
                        result.finish_reason = reason[0].decode()
                    n = res.as_numpy("num_output_tokens")
                    result.num_output_tokens += int(n[0]) if n is not None else 0
                    n_in = res.as_numpy("num_input_tokens")
                    result.num_input_tokens = int(n_in[0]) if n_in is not None else None
                    if piece:
                        yield piece
                if final is not None and final.bool_param:
                    finished = True
                    return
        finally:
            # A consumer that stops reading early (or an error) cancels the request on the server.
            client.stop_stream(cancel_requests=not finished)
            client.close()

    # --- HTTP -----------------------------------------------------------------------------------
    def _http_payload(self, prompt: str, sampling: dict, stream: bool) -> bytes:
        return json.dumps({"text_input": prompt, "stream": stream, "exclude_input_in_output": True,
                           "sampling_parameters": _sampling_json(sampling), "return_finish_reason": True,
                           "return_num_output_tokens": True, "return_num_input_tokens": True}).encode()

    def _http_generate(self, prompt: str, sampling: dict) -> GenerateResult:
        import urllib.error
        import urllib.request

        req = urllib.request.Request(f"http://{self.url}/v2/models/{self.model}/generate",
                                     data=self._http_payload(prompt, sampling, False), method="POST")
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                body = json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise ServerError(json.loads(e.read()).get("error", str(e))) from None
        return GenerateResult(text=body["text_output"], finish_reason=body.get("finish_reason"),
                              num_input_tokens=body.get("num_input_tokens"),
                              num_output_tokens=body.get("num_output_tokens", 0), chunks=[body["text_output"]])

    def _http_stream(self, prompt: str, sampling: dict, result: GenerateResult) -> Iterator[str]:
        import urllib.error
        import urllib.request

        req = urllib.request.Request(f"http://{self.url}/v2/models/{self.model}/generate_stream",
                                     data=self._http_payload(prompt, sampling, True), method="POST")
        try:
            resp = urllib.request.urlopen(req, timeout=600)
        except urllib.error.HTTPError as e:
            raise ServerError(json.loads(e.read()).get("error", str(e))) from None
        with resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise ServerError(event["error"])
                if event.get("finish_reason"):
                    result.finish_reason = event["finish_reason"]
                result.num_output_tokens += int(event.get("num_output_tokens", 0))
                result.num_input_tokens = event.get("num_input_tokens", result.num_input_tokens)
                if event.get("text_output"):
                    yield event["text_output"]
