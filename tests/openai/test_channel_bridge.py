"""The front end's side of the engine channel (openai/channel_bridge.py) against a stand-in for the model's
side (an asyncio Unix-socket server): what it sends, events of several requests interleaved in one line, errors,
leaving early sending a cancel, a broken connection failing what is open and the next request connecting again,
and no model there. The real channel, end to end, is tests/openai/test_openai_api.py's (`pagedllm serve`)."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from pagedllm.openai.channel_bridge import ChannelBridge
from pagedllm.openai.protocol import OpenAIError

pytestmark = [pytest.mark.openai]

PARAMS = {"temperature": "temperature"}


class FakeModel:
    """Records each line the bridge sends; `self.answer(model, message, writer)` answers a request."""

    def __init__(self) -> None:
        self.messages: list[dict] = []
        self.cancelled = asyncio.Event()
        self.writers: list[asyncio.StreamWriter] = []
        self.answer = None

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        while line := await reader.readline():
            message = json.loads(line)
            self.messages.append(message)
            if "cancel" in message:
                self.cancelled.set()
            else:
                await self.answer(self, message, writer)


def emit(writer: asyncio.StreamWriter, events: list) -> None:
    writer.write(json.dumps(events).encode() + b"\n")


def run_against(answer, body, tmp_path):
    async def main():
        fake = FakeModel()
        fake.answer = answer
        path = str(tmp_path / "model.sock")
        server = await asyncio.start_unix_server(fake.serve, path)
        bridge = ChannelBridge(path, "127.0.0.1:1")
        try:
            return await body(bridge, fake)
        finally:
            await bridge.close()
            server.close()

    return asyncio.run(main())


async def collect(bridge: ChannelBridge, **kwargs) -> list:
    async with contextlib.aclosing(bridge.generate({"max_tokens": 2}, PARAMS, **kwargs)) as deltas:
        return [d async for d in deltas]


async def two_tokens(fake, message, writer) -> None:
    rid = message["id"]
    emit(writer, [[rid, {"text_output": "a", "num_output_tokens": 1, "num_input_tokens": 3}]])
    emit(writer, [[rid, {"text_output": ["b", "c"], "num_output_tokens": [1, 1], "sequence_index": [0, 1],
                         "finish_reason": ["length", "length"], "final": True}]])


def test_a_request_goes_as_its_inputs_and_its_events_come_back_as_deltas(tmp_path):
    async def body(bridge, fake):
        return await collect(bridge, prompt="hi", logprobs=True), fake.messages

    got, messages = run_against(two_tokens, body, tmp_path)
    assert [(d.text, d.index, d.finish_reason) for d in got] == [("a", 0, None), ("b", 0, "length"),
                                                                 ("c", 1, "length")]
    assert got[0].num_input_tokens == 3
    inputs = messages[0]["inputs"]
    assert messages[0]["id"] == 0 and inputs["text_input"] == "hi" and inputs["return_logprobs"] is True
    assert json.loads(inputs["sampling_parameters"]) == {"max_tokens": 2}
    assert "heartbeat" not in inputs  # the channel hears of a cancellation without one


def test_requests_share_one_connection_and_one_line_serves_several(tmp_path):
    pending = []

    async def later(fake, message, writer) -> None:
        pending.append(message["id"])
        if len(pending) == 2:  # both answered in the same lines, interleaved
            emit(writer, [[i, {"text_output": f"x{i}", "num_output_tokens": 1}] for i in pending])
            emit(writer, [[i, {"text_output": "", "num_output_tokens": 0, "final": True}] for i in pending])

    async def body(bridge, fake):
        results = await asyncio.gather(collect(bridge, prompt="1"), collect(bridge, prompt="2"))
        return results, len(fake.writers)

    (first, second), connections = run_against(later, body, tmp_path)
    assert [d.text for d in first] == ["x0", ""] and [d.text for d in second] == ["x1", ""]
    assert connections == 1


def test_an_error_event_raises_with_the_models_status_and_field(tmp_path):
    async def refuse(fake, message, writer) -> None:
        emit(writer, [[message["id"], {"error": "temperature: must be >= 0", "final": True}]])

    async def body(bridge, fake):
        return await collect(bridge, prompt="x")

    with pytest.raises(OpenAIError) as e:
        run_against(refuse, body, tmp_path)
    assert (e.value.status, e.value.param) == (400, "temperature")


def test_leaving_early_sends_a_cancel(tmp_path):
    async def one_token(fake, message, writer) -> None:
        emit(writer, [[message["id"], {"text_output": "a", "num_output_tokens": 1}]])

    async def body(bridge, fake):
        async with contextlib.aclosing(bridge.generate({}, PARAMS, prompt="x")) as deltas:
            async for _ in deltas:
                break
        await asyncio.wait_for(fake.cancelled.wait(), 10)
        return fake.messages

    messages = run_against(one_token, body, tmp_path)
    assert messages[-1] == {"cancel": 0}


def test_a_broken_connection_is_a_502_and_the_next_request_connects_again(tmp_path):
    async def drop_first(fake, message, writer) -> None:
        if len(fake.writers) == 1:
            emit(writer, [[message["id"], {"text_output": "a", "num_output_tokens": 1}]])
            await writer.drain()
            writer.close()
        else:
            await two_tokens(fake, message, writer)

    async def body(bridge, fake):
        with pytest.raises(OpenAIError) as e:
            await collect(bridge, prompt="x")
        return e.value, await collect(bridge, prompt="y"), len(fake.writers)

    error, again, connections = run_against(drop_first, body, tmp_path)
    assert error.status == 502 and "broke off" in error.message
    assert [d.text for d in again] == ["a", "b", "c"] and connections == 2


def test_no_model_listening_is_a_503(tmp_path):
    async def main():
        bridge = ChannelBridge(str(tmp_path / "nobody.sock"), "127.0.0.1:1")
        try:
            await collect(bridge, prompt="x")
        finally:
            await bridge.close()

    with pytest.raises(OpenAIError) as e:
        asyncio.run(main())
    assert e.value.status == 503 and "unreachable" in e.value.message
