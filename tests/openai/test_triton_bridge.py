"""The bridge against a stand-in for Triton's `generate_stream` (aiohttp.web on a free loopback port): what it
sends, how it reads one sequence's and several sequences' events, errors before and during a stream, Triton
unreachable or cut off, and leaving early closing the connection (which is what makes Triton cancel). The real
endpoint, end to end, is tests/openai/test_openai_api.py's."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from aiohttp import web
from pagedllm.net import free_port
from pagedllm.openai.protocol import OpenAIError
from pagedllm.openai.triton_bridge import TritonBridge

PARAMS = {"temperature": "temperature"}


def event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class FakeTriton:
    """Answers generate_stream with `self.reply(request)`; records each request's body."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.client_left = asyncio.Event()  # set by a reply that saw its client go away
        self.reply = None

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        return await self.reply(request)

    async def ready(self, request: web.Request) -> web.Response:
        return web.Response(status=200)


async def streaming(request: web.Request, chunks: list[bytes], status: int = 200) -> web.StreamResponse:
    resp = web.StreamResponse(status=status, headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for chunk in chunks:
        await resp.write(chunk)
    await resp.write_eof()
    return resp


async def endless(request: web.Request, client_left: asyncio.Event | None = None) -> web.StreamResponse:
    """A stream that, as far as the bridge knows, ends only when its client leaves (then `client_left` is set)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    try:
        for _ in range(2000):
            await resp.write(event({"text_output": "a", "num_output_tokens": 1}))
            await asyncio.sleep(0.005)
    except ConnectionError:
        if client_left is not None:
            client_left.set()
    return resp


def run_against(reply, body):
    """Start the stand-in, run `body(bridge, fake)` against it, stop both."""

    async def main():
        fake = FakeTriton()
        fake.reply = reply
        app = web.Application()
        app.router.add_post("/v2/models/pagedllm/generate_stream", fake.generate_stream)
        app.router.add_get("/v2/models/pagedllm/ready", fake.ready)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        bridge = TritonBridge(f"127.0.0.1:{port}")
        try:
            return await body(bridge, fake)
        finally:
            await bridge.close()
            await runner.cleanup()

    return asyncio.run(main())


async def collect(bridge: TritonBridge, **kwargs) -> list:
    got = []
    async with contextlib.aclosing(bridge.generate({"max_tokens": 2}, PARAMS, **kwargs)) as deltas:
        async for d in deltas:
            got.append(d)
    return got


def texts_until_error(reply) -> tuple[list[str], OpenAIError]:
    """The texts of the deltas the bridge yields before it raises, and what it raises."""
    got = []

    async def body(bridge, fake):
        async with contextlib.aclosing(bridge.generate({}, PARAMS, prompt="x")) as deltas:
            async for d in deltas:
                got.append(d.text)

    with pytest.raises(OpenAIError) as e:
        run_against(reply, body)
    return got, e.value


def test_sends_one_streamed_request_and_reads_scalar_and_list_events():
    lp = json.dumps([{"7": {"logprob": -0.5, "rank": 1, "decoded_token": "a"}}])

    async def reply(request):
        return await streaming(request, [
            event({"text_output": "a", "finish_reason": "", "num_input_tokens": 4, "num_output_tokens": 1,
                   "logprobs": lp}),
            b": a comment line is not an event\n\n",
            event({"model_name": "pagedllm", "model_version": "1"}),  # a heartbeat: no outputs, no delta
            event({"text_output": ["b", "c"], "finish_reason": ["length", "stop"], "num_input_tokens": 4,
                   "num_output_tokens": [1, 2], "sequence_index": [0, 1], "logprobs": [lp, lp]})])

    async def body(bridge, fake):
        assert await bridge.is_ready()
        return await collect(bridge, messages=[{"role": "user", "content": "hi"}], logprobs=True), fake.bodies

    got, bodies = run_against(reply, body)
    assert [(d.text, d.index, d.finish_reason, d.num_output_tokens, d.num_input_tokens) for d in got] == [
        ("a", 0, None, 1, 4), ("b", 0, "length", 1, 4), ("c", 1, "stop", 2, None)]
    assert all(d.logprobs == json.loads(lp) for d in got)
    assert bodies == [{"stream": True, "sampling_parameters": json.dumps({"max_tokens": 2}),
                       "exclude_input_in_output": True, "return_finish_reason": True,
                       "return_num_input_tokens": True, "return_num_output_tokens": True,
                       "heartbeat": True, "messages": json.dumps([{"role": "user", "content": "hi"}]),
                       "return_logprobs": True}]


def test_a_final_only_request_asks_for_no_stream():
    async def reply(request):
        return await streaming(request, [event({"text_output": "ab", "finish_reason": "length",
                                                "num_output_tokens": 2})])

    async def body(bridge, fake):
        return await collect(bridge, prompt="x", deltas=False), fake.bodies

    got, bodies = run_against(reply, body)
    assert [(d.text, d.num_output_tokens) for d in got] == [("ab", 2)]
    assert bodies[0]["stream"] is False and bodies[0]["text_input"] == "x" and "messages" not in bodies[0]


def test_an_event_of_megabytes_is_read_whole_and_one_not_json_is_a_502():
    text = "x" * (3 << 20)  # more than aiohttp's readline takes (2 x its 256 KiB read buffer)

    async def reply(request):
        return await streaming(request, [event({"text_output": text, "num_output_tokens": 1})[i:i + 65536]
                                         for i in range(0, len(text) + 100, 65536)] + [b"data: {not json\n\n"])

    got, error = texts_until_error(reply)
    assert got == [text] and error.status == 502


def test_an_error_before_the_stream_keeps_its_field_and_status():
    async def reply(request):
        return web.Response(status=400, text='data: {"error":"temperature: must be a finite number >= 0"}\n\n')

    with pytest.raises(OpenAIError) as e:
        run_against(reply, lambda bridge, fake: collect(bridge, prompt="x"))
    assert (e.value.status, e.value.param) == (400, "temperature")


def test_an_error_event_mid_stream_is_raised_after_the_deltas_before_it():
    async def reply(request):
        return await streaming(request, [event({"text_output": "a", "num_output_tokens": 1}),
                                         event({"error": "engine failed: RuntimeError: boom"})])

    got, error = texts_until_error(reply)
    assert got == ["a"] and error.status == 503


def test_a_response_cut_off_is_a_502():
    async def reply(request):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(event({"text_output": "a", "num_output_tokens": 1}))
        request.transport.close()  # Triton gone mid-body: the chunked body never ends
        return resp

    with pytest.raises(OpenAIError) as e:
        run_against(reply, lambda bridge, fake: collect(bridge, prompt="x"))
    assert e.value.status == 502


def test_triton_unreachable_is_a_503_and_not_ready():
    async def main():
        bridge = TritonBridge(f"127.0.0.1:{free_port()}")  # nothing listens there
        try:
            assert not await bridge.is_ready()
            await collect(bridge, prompt="x")
        finally:
            await bridge.close()

    with pytest.raises(OpenAIError) as e:
        asyncio.run(main())
    assert e.value.status == 503


def test_a_port_that_does_not_speak_http_is_not_ready_and_says_so(caplog):
    async def main():
        async def not_http(reader, writer):  # as an HTTP/2-only (gRPC) port answers an HTTP/1.1 request
            await reader.read(100)
            writer.write(bytes.fromhex("000006040000000000000500004000"))
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(not_http, "127.0.0.1", 0)
        bridge = TritonBridge(f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
        try:
            return await bridge.is_ready()
        finally:
            await bridge.close()
            server.close()

    assert asyncio.run(main()) is False
    assert "--triton-url takes its HTTP port" in caplog.text


def test_leaving_early_closes_the_connection():
    fake = None

    async def reply(request):
        return await endless(request, fake.client_left)

    async def body(bridge, the_fake):
        nonlocal fake
        fake = the_fake
        async with contextlib.aclosing(bridge.generate({}, PARAMS, prompt="x")) as deltas:
            async for _ in deltas:
                break  # the HTTP client went away after one token
        await asyncio.wait_for(fake.client_left.wait(), timeout=10)
        return True

    assert run_against(reply, body)


def test_requests_read_to_their_end_reuse_one_connection_and_one_left_early_does_not():
    peers = []  # each request's client address: the same address means the same kept-alive connection

    async def reply(request):
        peers.append(request.transport.get_extra_info("peername"))
        if (await request.json())["text_input"] == "endless":
            return await endless(request)
        return await streaming(request, [event({"text_output": t, "num_output_tokens": 1}) for t in "ab"])

    async def body(bridge, fake):
        assert [d.text for d in await collect(bridge, prompt="x")] == ["a", "b"]
        assert [d.text for d in await collect(bridge, prompt="y")] == ["a", "b"]
        async with contextlib.aclosing(bridge.generate({}, PARAMS, prompt="endless")) as deltas:
            async for _ in deltas:
                break  # left after one token: its connection is closed, not pooled
        await collect(bridge, prompt="w")
        return True

    assert run_against(reply, body)
    assert peers[0] == peers[1] == peers[2] and peers[3] != peers[2]
