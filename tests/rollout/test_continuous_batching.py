"""Continuous batching in the HF engine (decode_batch.py, stream.py): sequences join a running decode
batch between steps and leave it when they finish, and every sample equals the one the batch call
gives for its prompt and seed alone."""
import threading
import time

import pytest
import torch

from posttrain.rollout import HFRolloutEngine, SamplingParams
from posttrain.rollout.types import rank_seed

LONG, SHORT = [5, 6, 7, 8, 9, 10, 11, 12, 13], [14, 15]


def alone(engine, prompt, params, seed, budget):
    return engine.generate([prompt], params, max_new_tokens=[budget], seeds=[seed])[0][0]


def same(a, b):
    assert a.output_token_ids == b.output_token_ids and a.finish_reason == b.finish_reason
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def sequences(engine, prompt, params, seed, budget):
    return engine.sequences([prompt], params, [budget], [seed])


@pytest.mark.parametrize("first,second", [(SHORT, LONG), (LONG, SHORT)],
                         ids=["joiner-longer", "joiner-shorter"])
def test_a_sequence_joining_mid_generation_samples_as_if_alone(engine, first, second):
    """The joiner's prompt is longer, then shorter, than the running row's cache: either side is padded."""
    params = SamplingParams(temperature=1.0, n=1, stop_token_ids=(10**6,))  # never stops early
    a, b = sequences(engine, first, params, 3, 12)[0], sequences(engine, second, params, 4, 6)[0]
    with engine.inference():
        batch = engine.decode_batch()
        batch.admit([a])
        for _ in range(4):
            batch.step()
        batch.admit([b])
        assert len(batch) == 2 and len(a.tokens) == 4 and not b.tokens
        while len(batch):
            batch.step()
    same(a.output(), alone(engine, first, params, 3, 12))
    same(b.output(), alone(engine, second, params, 4, 6))


def test_rows_with_different_sampling_settings_share_a_batch(engine):
    settings = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.8),
                SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, stop_token_ids=(5, 6, 7, 8))]
    prompts = [LONG, SHORT, [20, 21, 22], [30]]
    seqs = [sequences(engine, p, s, 10 + i, 8)[0] for i, (p, s) in enumerate(zip(prompts, settings))]
    with engine.inference():
        batch = engine.decode_batch()
        batch.admit(seqs)
        while len(batch):
            batch.step()
    for i, (p, s) in enumerate(zip(prompts, settings)):
        same(seqs[i].output(), alone(engine, p, s, 10 + i, 8))


def test_finished_rows_leave_and_unused_columns_are_trimmed(engine):
    params = SamplingParams(temperature=1.0)
    long_prompt = list(range(40, 80))
    a, b = sequences(engine, long_prompt, params, 1, 1)[0], sequences(engine, SHORT, params, 2, 6)[0]
    with engine.inference():
        batch = engine.decode_batch()
        batch.admit([a, b])
        assert batch.mask.shape == (2, 40)
        assert batch.step() == [a]  # a's budget is one token
        # b's 2 prompt tokens + 1 new; 38 pad columns gone
        assert len(batch) == 1 and batch.mask.shape[1] == 3
        assert all(layer.keys.shape[2] == 3 for layer in batch.cache.layers)  # the cache too
        while len(batch):
            batch.step()
    same(b.output(), alone(engine, SHORT, params, 2, 6))


def test_waiting_rows_join_as_soon_as_rows_finish(model, tokenizer):
    """batch_size 2, budgets 1, 8, 8: the third row starts when the first finishes (not after the second)."""
    engine = HFRolloutEngine(model, tokenizer, pad_token_id=tokenizer.pad_token_id, batch_size=2)
    forwards = []
    hook = model.register_forward_hook(lambda *a: forwards.append(1))
    params = SamplingParams(temperature=1.0, stop_token_ids=(10**6,))
    try:
        out = engine.generate([LONG, SHORT, [20, 21]], params, max_new_tokens=[1, 8, 8], seeds=[1, 2, 3])
    finally:
        hook.remove()
    assert [len(g[0].output_token_ids) for g in out] == [1, 8, 8]
    assert len(forwards) <= 11  # chunks of 2 would take 2 prefills + 7 + 7 decode forwards = 16
    for i, (p, b) in enumerate(zip([LONG, SHORT, [20, 21]], [1, 8, 8])):
        same(out[i][0], alone(engine, p, params, i + 1, b))


def test_a_model_whose_cache_cannot_merge_joins_at_batch_boundaries(tokenizer):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, sliding_window=64)
    engine = HFRolloutEngine(MistralForCausalLM(cfg).eval(), tokenizer, pad_token_id=tokenizer.pad_token_id,
                             batch_size=2)
    params = SamplingParams(temperature=1.0, stop_token_ids=(10**6,))
    a, b = sequences(engine, LONG, params, 1, 3)[0], sequences(engine, SHORT, params, 2, 3)[0]
    with engine.inference():
        batch = engine.decode_batch()
        batch.admit([a])
        assert not batch.mergeable and not batch.can_admit()
        with pytest.raises(RuntimeError, match="cannot merge"):
            batch.admit([b])
    out = engine.generate([LONG, SHORT, [20, 21]], params, max_new_tokens=[1, 3, 3], seeds=[1, 2, 3])
    for i, (p, budget) in enumerate(zip([LONG, SHORT, [20, 21]], [1, 3, 3])):
        same(out[i][0], alone(engine, p, params, i + 1, budget))


# -- the decode thread (stream.DecodeServer) --------------------------------------------------------
class Results:
    def __init__(self):
        self.done, self.order, self.event = {}, [], threading.Event()

    def callback(self, name, expected):
        def on_done(outputs, error):
            self.done[name] = (outputs, error)
            self.order.append(name)
            if len(self.done) == expected:
                self.event.set()
        return on_done


def test_a_request_from_another_thread_joins_the_running_batch(engine):
    server = engine.stream()
    results = Results()
    params = SamplingParams(temperature=1.0, stop_token_ids=(10**6,))  # no early stop: budgets decide
    try:
        server.submit(LONG, params, 7, 60, results.callback("long", 2))
        deadline = time.time() + 30
        while server.steps < 3 and time.time() < deadline:
            time.sleep(0.001)
        server.submit(SHORT, params, 8, 3, results.callback("short", 2))
        assert results.event.wait(60)
    finally:
        server.close()
    assert results.order == ["short", "long"]  # it did not wait for the long one to finish
    assert server.max_live == 2
    same(results.done["long"][0][0], alone(engine, LONG, params, 7, 60))
    same(results.done["short"][0][0], alone(engine, SHORT, params, 8, 3))


def test_n_samples_per_request_match_the_batch_call(engine):
    server = engine.stream()
    results = Results()
    params = SamplingParams(temperature=1.0, n=3, max_new_tokens=5)
    try:
        server.submit(SHORT, params, 21, None, results.callback("x", 1))
        assert results.event.wait(60)
    finally:
        server.close()
    direct = engine.generate([SHORT], params, seeds=[21])[0]
    for a, b in zip(results.done["x"][0], direct):
        same(a, b)
    assert [o.output_token_ids for o in direct] != [direct[0].output_token_ids] * 3  # distinct generators


def test_a_malformed_request_fails_alone_and_an_engine_error_fails_those_in_flight(model, tokenizer):
    engine = HFRolloutEngine(model, tokenizer, pad_token_id=tokenizer.pad_token_id)
    server = engine.stream()
    results = Results()
    params = SamplingParams(temperature=1.0, max_new_tokens=4)
    hook = None
    try:
        server.submit_all([([10**7], params, 1, None, results.callback("bad", 2)),
                           (SHORT, params, 2, None, results.callback("good", 2))])
        assert results.event.wait(60)
        assert (isinstance(results.done["bad"][1], ValueError)
                and "token ids must be integers" in str(results.done["bad"][1]))
        assert results.done["good"][1] is None

        def lost(*args):
            raise RuntimeError("device lost")
        broken = Results()
        hook = model.register_forward_pre_hook(lost)
        server.submit_all([(SHORT, params, 3, None, broken.callback("a", 2)),
                           (LONG, params, 4, None, broken.callback("b", 2))])
        assert broken.event.wait(60)
        hook.remove()
        assert {str(e) for _, e in broken.done.values()} == {"device lost"}
        after = Results()
        server.submit(SHORT, params, 2, None, after.callback("again", 1))  # the server still serves
        assert after.event.wait(60)
        same(after.done["again"][0][0], results.done["good"][0][0])
    finally:
        if hook is not None:
            hook.remove()
        server.close()


def test_per_prompt_seeds_of_the_stream_are_those_of_the_batch_call(engine):
    """A request seeded with rank_seed(base, 0, i) samples what prompt i of an unseeded-list call does."""
    params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=99)
    direct = engine.generate([LONG, SHORT], params)
    server, results = engine.stream(), Results()
    try:
        for i, p in enumerate([LONG, SHORT]):
            server.submit(p, params, rank_seed(99, 0, i), None, results.callback(i, 2))
        assert results.event.wait(60)
    finally:
        server.close()
    for i in range(2):
        same(results.done[i][0][0], direct[i][0])


def test_the_decode_thread_restores_train_mode_when_idle(tiny_model_dir, tokenizer):
    from posttrain.models import load_causal_lm

    model = load_causal_lm(tiny_model_dir, dtype="fp32").train()
    engine = HFRolloutEngine(model, tokenizer, pad_token_id=tokenizer.pad_token_id)
    server, results = engine.stream(), Results()
    seen = []
    hook = model.register_forward_hook(lambda m, *a: seen.append((m.training, torch.is_grad_enabled())))
    try:
        server.submit(SHORT, SamplingParams(max_new_tokens=3), 1, None, results.callback(0, 1))
        assert results.event.wait(60)
        deadline = time.time() + 10
        while not all(m.training for m in model.modules()) and time.time() < deadline:
            time.sleep(0.01)
    finally:
        hook.remove()
        server.close()
    assert seen and set(seen) == {(False, False)}  # eval mode, no graph, while decoding
    assert all(m.training for m in model.modules())


def test_a_request_that_finished_in_a_failing_step_still_gets_its_answer(model, tokenizer):
    """The decode forward fails right after a row finished and left the batch: its request is settled
    with the error too, not lost (a caller waiting on it would hang)."""
    engine = HFRolloutEngine(model, tokenizer, pad_token_id=tokenizer.pad_token_id)
    server, results = engine.stream(), Results()
    params = SamplingParams(temperature=1.0, stop_token_ids=(10**6,))
    calls = []
    forward = engine._forward

    def fail_on_first_decode(input_ids, *args):
        calls.append(input_ids.shape)
        if len(calls) == 3:  # 1: prefill, 2: decode after token 1, 3: decode after "short" finished
            raise RuntimeError("device lost")
        return forward(input_ids, *args)

    engine._forward = fail_on_first_decode  # every forward of the decode loop (prefill and decode steps)
    try:
        server.submit_all([(SHORT, params, 1, 2, results.callback("short", 2)),
                           (LONG, params, 2, 8, results.callback("long", 2))])
        assert results.event.wait(60), f"a request was never settled: {results.done}"
    finally:
        server.close()
    assert calls[2][0] == 1  # the finished row had left the batch before the failing forward
    assert {str(e) for _, e in results.done.values()} == {"device lost"}


def test_a_request_submitted_while_the_decode_thread_exits_is_served(engine):
    """A request that arrives just as the closing thread decides to exit (simulated: submitted from the
    exit path itself) is served, by that thread or a new one, never stranded in the inbox."""
    params = SamplingParams(temperature=1.0, max_new_tokens=1)
    server = engine.stream()
    first, late = Results(), Results()
    exit_checks = []
    real_exit = server._exit

    def exit_with_a_late_arrival():
        if not exit_checks:
            server.submit(SHORT, params, 2, None, late.callback(0, 1))
        exit_checks.append(1)
        return real_exit()

    server._exit = exit_with_a_late_arrival
    server.submit(SHORT, params, 1, None, first.callback(0, 1))
    assert first.event.wait(60)
    server.close()
    assert late.event.wait(30), "a request submitted during the exit was never served"
    server.close(timeout=30)
    assert server._thread is None and len(exit_checks) >= 2


def test_unseeded_requests_follow_the_params_seed_as_the_batch_call_does(engine):
    """generate_all with params.seed and no per-prompt seeds: prompt i gets rank_seed(seed, 0, i), exactly
    as engine.generate, through the stream too (not the same seed for every request)."""
    from posttrain.rollout.async_engine import generate_all

    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=5, stop_token_ids=(10**6,))
    direct = engine.generate([SHORT, SHORT, LONG], params)
    streamed = generate_all(engine, [SHORT, SHORT, LONG], params)
    for a, b in zip(streamed, direct):
        same(a[0], b[0])
    assert streamed[0][0].output_token_ids != streamed[1][0].output_token_ids


def test_a_cancelled_request_stops_decoding_and_close_joins_the_thread(tiny_model_dir, tokenizer):
    """An episode that timed out cancels its request: its rows leave the batch at the next step, and
    the model is back in train mode when the front closes (nothing decodes on it afterwards)."""
    import asyncio

    from posttrain.models import load_causal_lm
    from posttrain.rollout.async_engine import AsyncRolloutEngine

    model = load_causal_lm(tiny_model_dir, dtype="fp32").train()
    engine = HFRolloutEngine(model, tokenizer, pad_token_id=tokenizer.pad_token_id)
    params = SamplingParams(temperature=1.0, stop_token_ids=(10**6,))
    slow = model.register_forward_pre_hook(lambda *a: time.sleep(0.02))

    async def main(front):
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(front.generate(LONG, params, seed=1, max_new_tokens=10_000), 0.5)
        steps = front.stream.steps
        await asyncio.sleep(0.5)
        return steps, front.stream.steps

    front = AsyncRolloutEngine(engine)
    try:
        at_timeout, later = asyncio.run(main(front))
    finally:
        front.close(timeout=30)
        slow.remove()
    assert later <= at_timeout + 2  # the step in flight, then it leaves: far short of its 10,000 tokens
    assert front.stream._thread is None and not front.stream._open
    assert all(m.training for m in model.modules())
