"""The engine thread used by the Triton adapter: outputs, per-request errors, abort, and engine death."""

import pytest

from conftest import Collector, assert_all_blocks_free, wait_for
from pagedllm import LLM, SamplingParams
from pagedllm.serving.engine_loop import EngineDeadError, EngineLoop


@pytest.fixture
def llm(llama_dir):
    return LLM(llama_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=8 << 20, max_queue_size=4)


def test_outputs_errors_and_abort(llm):
    c = Collector()
    loop = EngineLoop(llm.engine, c)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    loop.submit("a", llm.engine.input_processor.process([0, 5, 6], params))
    loop.submit("dup", llm.engine.input_processor.process([0, 5], params))
    loop.submit("dup", llm.engine.input_processor.process([0, 5], params))  # duplicate id: an error for that submission only
    loop.submit("long", llm.engine.input_processor.process([0, 7], SamplingParams(max_tokens=200, ignore_eos=True)))
    wait_for(lambda: "a" in c.finished and "dup" in c.finished)
    loop.abort("long")
    wait_for(lambda: "long" in c.finished)
    assert c.finished["a"].outputs[0].token_ids.__len__() == 8
    assert c.finished["long"].outputs[0].finish_reason == "abort"
    errors = [err for rid, _, err in c.items if err is not None]
    assert len(errors) == 1 and "request_id" in str(errors[0])
    loop.stop()
    assert_all_blocks_free(llm)


def test_a_failing_step_fails_every_request_and_marks_the_loop_dead(llm, monkeypatch):
    c = Collector()
    dead = []
    loop = EngineLoop(llm.engine, c, on_dead=dead.append)

    def boom(*args, **kwargs):
        raise RuntimeError("simulated device fault")

    monkeypatch.setattr(llm.engine.executor, "execute_step", boom)
    loop.submit("x", llm.engine.input_processor.process([0, 5, 6], SamplingParams(max_tokens=4)))
    loop.submit("y", llm.engine.input_processor.process([0, 9], SamplingParams(max_tokens=4)))
    wait_for(lambda: len(c.finished) == 2)
    assert all(isinstance(e, EngineDeadError) and "simulated device fault" in str(e) for e in c.finished.values())
    assert not loop.healthy and len(dead) == 1
    with pytest.raises(EngineDeadError):
        loop.submit("z", llm.engine.input_processor.process([0, 1], SamplingParams()))
