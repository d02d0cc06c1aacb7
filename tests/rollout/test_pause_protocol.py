"""The HF engine's pause protocol (`paused()` / `decode_step()`): a weight load holds the engine between
decode steps, the thread that holds it never waits for itself, and other threads' steps wait for the load.
Every wait runs in a daemon thread joined with a limit, so a deadlock fails the test instead of hanging it."""
import threading
import time

import pytest

STUCK_S = 60  # a join that outlives this is a deadlock


@pytest.fixture
def engine(model, tokenizer):
    """An engine of its own per test: a deadlocked one cannot hold up the next test."""
    from posttrain.rollout import HFRolloutEngine

    return HFRolloutEngine(model, tokenizer, pad_token_id=tokenizer.pad_token_id)


def _run(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_the_holding_thread_steps_and_pauses_again_without_waiting_for_itself(engine):
    done = []

    def load_then_step():
        with engine.paused():
            with engine.paused():  # a load inside a sync's pause (load_weights in paused)
                engine.weights_updated(None)
            with engine.decode_step():
                with engine.decode_step():
                    done.append("steps")

    thread = _run(load_then_step)
    thread.join(STUCK_S)
    assert not thread.is_alive() and done == ["steps"]


def test_another_threads_decode_step_waits_until_the_pause_ends(engine):
    entered = threading.Event()

    def step():
        with engine.decode_step():
            entered.set()

    with engine.paused():
        thread = _run(step)
        assert not entered.wait(0.3)  # held off while the engine is paused
    assert entered.wait(STUCK_S)
    thread.join(STUCK_S)


def test_a_waiting_load_gets_the_engine_at_the_next_step_boundary(engine):
    """A decode loop taking steps back to back does not starve a load; no step runs while it holds."""
    stop, steps, seen = threading.Event(), [], {}

    def loop():
        while not stop.is_set():
            with engine.decode_step():
                steps.append(1)
                time.sleep(0.001)

    def load():
        with engine.paused():
            before = len(steps)
            time.sleep(0.05)
            seen["steps during the pause"] = len(steps) - before

    looping = _run(loop)
    while not steps:
        time.sleep(0.001)
    loading = _run(load)
    loading.join(STUCK_S)
    stop.set()
    looping.join(STUCK_S)
    assert not loading.is_alive() and seen == {"steps during the pause": 0}


def test_a_step_nested_in_a_step_goes_on_while_a_load_waits(engine):
    """The thread inside a decode step may enter another (reentrant) even while a load from another thread
    is waiting for the engine: it must not wait for that load, which waits for it."""
    inside, load_waiting, order = threading.Event(), threading.Event(), []

    def stepper():
        with engine.decode_step():
            inside.set()
            load_waiting.wait(STUCK_S)
            deadline = time.monotonic() + STUCK_S
            while engine.gate._loads_waiting == 0 and time.monotonic() < deadline:  # the load is now blocked
                time.sleep(0.001)                                                  # on the engine held here
            assert engine.gate._loads_waiting == 1
            with engine.decode_step():
                order.append("nested step")

    def load():
        load_waiting.set()
        with engine.paused():
            order.append("load")

    stepping = _run(stepper)
    assert inside.wait(STUCK_S)
    loading = _run(load)
    stepping.join(STUCK_S)
    loading.join(STUCK_S)
    assert not stepping.is_alive() and not loading.is_alive()
    assert order == ["nested step", "load"]
