"""The engine thread used by the Triton adapter: outputs, per-request errors, abort, engine death and the
bounded, backed-off restarts after it."""

import dataclasses
import gc
import threading
import time
import weakref

import pytest

from conftest import Collector, assert_all_blocks_free, wait_for
from pagedllm import LLM, SamplingParams
from pagedllm.engine.engine import LLMEngine
from pagedllm.serving.engine_loop import EngineDeadError, EngineLoop


@pytest.fixture
def llm(llama_dir):
    return LLM(llama_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=8 << 20, max_queue_size=4)


def _fail_forward(engine):
    def boom(*args, **kwargs):
        raise RuntimeError("simulated device fault")

    engine.executor.execute_step = boom


def test_outputs_errors_and_abort(llm):
    c = Collector()
    loop = EngineLoop(lambda: None, c, engine=llm.engine)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    process = llm.engine.input_processor.process
    loop.submit("a", process([0, 5, 6], params))
    loop.submit("dup", process([0, 5], params))
    loop.submit("dup", process([0, 5], params))  # duplicate id: an error for that submission only
    loop.submit("long", process([0, 7], SamplingParams(max_tokens=200, ignore_eos=True)))
    wait_for(lambda: "a" in c.finished and "dup" in c.finished)
    loop.abort("long")
    wait_for(lambda: "long" in c.finished)
    assert len(c.finished["a"].outputs[0].token_ids) == 8
    assert c.finished["long"].outputs[0].finish_reason == "abort"
    errors = [err for rid, _, err in c.items if err is not None]
    assert len(errors) == 1 and "request_id" in str(errors[0])
    loop.stop()
    assert_all_blocks_free(llm)


def _slow_steps(engine, seconds: float) -> threading.Event:
    """Every step takes at least `seconds`; the event is set while one is running."""
    inside, step = threading.Event(), engine.executor.execute_step

    def slow(*args, **kwargs):
        inside.set()
        time.sleep(seconds)
        return step(*args, **kwargs)

    engine.executor.execute_step = slow
    return inside


def test_a_request_received_during_a_step_is_timed_from_its_receipt(llm):
    """The engine takes requests only between steps: a server's request carries when it was received, and its
    queue time, TTFT and deadline count from then, the wait for the step in progress included."""
    c = Collector()
    loop = EngineLoop(lambda: None, c, engine=llm.engine)
    inside = _slow_steps(llm.engine, 0.3)
    process = llm.engine.input_processor.process
    loop.submit("busy", process([0, 7], SamplingParams(max_tokens=3, ignore_eos=True)))
    inside.wait(10)
    received = time.monotonic()  # the step in progress has ~0.3 s left
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    loop.submit("late", dataclasses.replace(process([0, 5, 6], params), arrival_time=received))
    loop.submit("expired", dataclasses.replace(process([0, 5, 6], params, timeout=0.1), arrival_time=received))
    wait_for(lambda: len(c.finished) == 3)
    metrics = c.finished["late"].metrics
    assert metrics.arrival_time == received
    assert metrics.first_scheduled_time - received >= 0.1  # it waited out the step it arrived in
    # Its 0.1 s deadline passed while the step ran: it ends with no token rather than being timed from its take-up.
    expired = c.finished["expired"].outputs[0]
    assert expired.finish_reason == "timeout" and expired.token_ids == []
    loop.stop()
    assert_all_blocks_free(llm)


def test_a_failing_step_fails_every_request_once_and_without_restarts_the_loop_stays_dead(llm):
    c, dead = Collector(), []
    loop = EngineLoop(lambda: pytest.fail("no restart expected"), c, on_dead=dead.append, engine=llm.engine,
                      max_restarts=0)
    _fail_forward(llm.engine)
    process = llm.engine.input_processor.process
    loop.submit("x", process([0, 5, 6], SamplingParams(max_tokens=4)))
    loop.submit("y", process([0, 9], SamplingParams(max_tokens=4)))
    wait_for(lambda: len(c.finished) == 2)
    assert all(isinstance(e, EngineDeadError) and "simulated device fault" in str(e) for e in c.finished.values())
    assert [rid for rid, _, _ in c.items] in (["x", "y"], ["y", "x"])  # exactly one final each
    assert not loop.healthy and len(dead) == 1 and loop.engine is None
    with pytest.raises(EngineDeadError):
        loop.submit("z", process([0, 1], SamplingParams()))
    loop.stop()
    assert not loop.running


def test_a_dead_engine_is_rebuilt_and_serves_again(llm):
    c, dead, up = Collector(), [], []
    config = llm.engine.config
    loop = EngineLoop(lambda: LLMEngine(config), c, on_dead=dead.append, on_up=lambda: up.append(1),
                      engine=llm.engine, backoff_s=0.05)
    _fail_forward(llm.engine)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    loop.submit("before", llm.engine.input_processor.process([0, 5, 6], params))
    wait_for(lambda: "before" in c.finished)
    assert isinstance(c.finished["before"], EngineDeadError)
    wait_for(lambda: loop.healthy and up, timeout=120)
    assert loop.restarts == 1 and len(dead) == 1 and loop.engine is not llm.engine
    loop.submit("after", loop.engine.input_processor.process([0, 5, 6], params))
    wait_for(lambda: "after" in c.finished, timeout=60)
    expected = LLM(config.model, dtype="float32", max_model_len=256).generate([[0, 5, 6]], params, use_tqdm=False)
    assert c.finished["after"].outputs[0].token_ids == expected[0].outputs[0].token_ids
    engine = loop.engine
    loop.stop()
    assert engine.kv.all_free()


def test_with_freeze_heap_the_heap_is_frozen_while_an_engine_serves_and_a_dead_engine_is_collected(llm):
    c, at_death, at_up = Collector(), [], []
    config = llm.engine.config
    first = LLMEngine(config)
    _fail_forward(first)
    loop = EngineLoop(lambda: LLMEngine(config), c, on_dead=lambda e: at_death.append(gc.get_freeze_count()),
                      on_up=lambda: at_up.append(gc.get_freeze_count()), engine=first, backoff_s=0.05,
                      freeze_heap=True)
    try:
        assert gc.get_freeze_count() > 0  # the first engine's heap
        first_ref, process = weakref.ref(first), first.input_processor.process
        del first
        loop.submit("x", process([0, 5, 6], SamplingParams(max_tokens=4)))
        wait_for(lambda: loop.healthy and at_up, timeout=120)
        assert at_death == [0] and at_up[0] > 0  # unfrozen before the dead engine was dropped, frozen once rebuilt
        gc.collect()
        assert first_ref() is None  # nothing frozen keeps the dead engine
    finally:
        loop.stop()
    assert gc.get_freeze_count() == 0


def test_restart_attempts_are_bounded_and_requests_meanwhile_are_refused(llm):
    c, attempts = Collector(), []

    def failing_build():
        attempts.append(1)
        raise RuntimeError("still broken")

    loop = EngineLoop(failing_build, c, engine=llm.engine, max_restarts=3, backoff_s=0.02)
    _fail_forward(llm.engine)
    loop.submit("x", llm.engine.input_processor.process([0, 5], SamplingParams(max_tokens=4)))
    wait_for(lambda: "x" in c.finished)
    wait_for(lambda: len(attempts) == 3)
    with pytest.raises(EngineDeadError, match="still|simulated"):
        loop.submit("y", llm.engine.input_processor.process([0, 5], SamplingParams(max_tokens=4)))
    loop.stop()
    assert len(attempts) == 3 and loop.restarts == 0


def test_the_engine_is_built_on_the_engine_thread_and_its_failure_raised(llm):
    """Built and stepped on one thread (one OpenMP pool: see engine_loop's docstring); a start that fails
    raises from the constructor, as building on the caller's thread did."""
    import threading

    built_on = []

    def make():
        built_on.append(threading.current_thread().name)
        return llm.engine

    loop = EngineLoop(make, Collector())
    assert built_on == ["pagedllm-engine"] and loop.engine is llm.engine and loop.healthy
    loop.stop()

    def broken():
        raise ValueError("kv_cache_memory_bytes: too small")

    with pytest.raises(ValueError, match="too small"):
        EngineLoop(broken, Collector())
