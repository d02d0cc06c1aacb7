"""HFRolloutEngine on the nano llama: log-probs match the training forward, padding invariance,
stopping, seeding, n samples, mode/grad hygiene, weights, errors."""
import pytest
import torch

from posttrain.algorithms.losses import token_logprobs
from posttrain.models import forward_logits, load_causal_lm
from posttrain.rollout import (
    HFRolloutEngine,
    RolloutEngine,
    SamplingParams,
    make_rollout_engine,
    rank_seed,
    resolve_eos_ids,
)

PROMPTS = [[5, 17, 300, 42, 9], [11], [700, 701, 702, 703, 704, 705, 706, 707, 708], [64, 65, 66]]
FREQUENT_STOPS = list(range(100, 300))  # ~10% of the vocabulary: samples stop at varied lengths


def recomputed_logprobs(model, outputs, temperature, pad_id=0):
    """Training-side log-probs: one right-padded forward over prompt+response through
    `forward_logits`, `token_logprobs(logits[:, :-1], ids[:, 1:], T)` at the response positions."""
    seqs = [o.prompt_token_ids + o.output_token_ids for o in outputs]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    with torch.no_grad():
        logits = forward_logits(model, {"input_ids": ids, "attention_mask": mask})
    lp = token_logprobs(logits[:, :-1], ids[:, 1:], temperature)
    return [lp[i, len(o.prompt_token_ids) - 1:len(o.prompt_token_ids) - 1 + len(o.output_token_ids)]
            for i, o in enumerate(outputs)]


@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (0.7, 0.9), (1.3, 0.9), (1.3, 1.0)])
def test_rollout_logprobs_equal_training_logprobs(model, engine, temperature, top_p):
    params = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=12, n=3, seed=7,
                            stop_token_ids=FREQUENT_STOPS)
    outputs = [o for group in engine.generate(PROMPTS, params) for o in group]
    reasons = {o.finish_reason for o in outputs}
    assert reasons == {"stop", "length"}, reasons  # both kinds, so responses have different lengths
    for out, ref in zip(outputs, recomputed_logprobs(model, outputs, temperature)):
        assert len(out.logprobs) == len(out.output_token_ids) == ref.numel()
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-5, rtol=0)


def test_left_padded_batch_equals_each_prompt_alone(engine):
    params = SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=[257])
    batched = engine.generate(PROMPTS, params)
    alone = [engine.generate([p], params)[0] for p in PROMPTS]
    chunked = HFRolloutEngine(engine.model, [2], pad_token_id=0, batch_size=3).generate(PROMPTS, params)
    for b, a, c in zip(batched, alone, chunked):
        assert b[0].output_token_ids == a[0].output_token_ids == c[0].output_token_ids
        assert b[0].finish_reason == a[0].finish_reason
        torch.testing.assert_close(torch.tensor(b[0].logprobs), torch.tensor(a[0].logprobs), atol=1e-5,
                                   rtol=0)
    # prompt [11] stops at 257, others don't
    assert {o[0].finish_reason for o in batched} == {"stop", "length"}


def _sample(engine, prompt, seed, max_new=20, stop=()):
    # min_tokens 0: a ban on the stop ids at the first token would change its draw (the mass it maps onto)
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new, seed=seed, stop_token_ids=list(stop),
                            min_tokens=0)
    return engine.generate([prompt], params)[0][0]


def test_stops_at_the_first_of_several_stop_ids_and_keeps_it(engine):
    full = _sample(engine, PROMPTS[0], seed=3)
    toks = full.output_token_ids
    assert full.finish_reason == "length" and len(toks) == 20
    k = next(i for i in range(3, 20) if toks[i] not in toks[:i])
    later = next(t for t in toks[k + 1:] if t not in toks[:k + 1])
    unused = next(t for t in range(1972) if t not in toks)
    out = _sample(engine, PROMPTS[0], seed=3, stop=[unused, later, toks[k]])
    assert out.output_token_ids == toks[:k + 1]  # same seed, same draws; stop token included
    assert out.finish_reason == "stop"
    assert out.logprobs == full.logprobs[:k + 1]


def test_truncated_sample_is_not_rewritten(engine):
    short = _sample(engine, PROMPTS[1], seed=4, max_new=6)
    long = _sample(engine, PROMPTS[1], seed=4, max_new=15)
    assert short.finish_reason == "length" and len(short.output_token_ids) == 6
    assert short.output_token_ids == long.output_token_ids[:6]  # the last token is the sampled one, not eos
    assert 257 not in short.output_token_ids


def test_min_tokens_bans_the_stop_ids_until_reached(model, engine):
    """FREQUENT_STOPS are ~10% of the vocabulary: without a minimum some samples stop at their first token;
    min_tokens=1 (the default) and 4 never stop earlier, and the log-probs stay the trainer's."""
    def lengths(min_tokens, max_new=12):
        params = SamplingParams(temperature=1.0, max_new_tokens=max_new, n=8, seed=11,
                                stop_token_ids=FREQUENT_STOPS, min_tokens=min_tokens)
        outputs = [o for group in engine.generate(PROMPTS, params) for o in group]
        return outputs, [len(o.output_token_ids) for o in outputs if o.finish_reason == "stop"]

    _, free = lengths(0)
    assert min(free) == 1, free  # without a minimum the first token can end a sample
    assert min(lengths(1)[1]) >= 2 and SamplingParams().min_tokens == 1
    outputs, stopped = lengths(4)
    assert stopped and min(stopped) >= 5
    for out, ref in zip(outputs, recomputed_logprobs(model, outputs, 1.0)):
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-5, rtol=0)  # full distribution
    # a budget below the minimum ends the sample at the budget ("length"), never at a stop id
    outputs, stopped = lengths(4, max_new=3)
    assert not stopped and {len(o.output_token_ids) for o in outputs} == {3}
    # greedy: the first token is the best one that is not a stop id
    first = engine.generate([[11]], SamplingParams(temperature=0, max_new_tokens=1))[0][0].output_token_ids[0]
    banned = engine.generate([[11]],
                             SamplingParams(temperature=0, max_new_tokens=2, stop_token_ids=[first]))[0][0]
    assert banned.output_token_ids[0] != first
    assert engine.generate([[11]], SamplingParams(temperature=0, max_new_tokens=2, stop_token_ids=[first],
                                                  min_tokens=0))[0][0].output_token_ids == [first]


def test_pad_id_equal_to_stop_id(model, engine):
    """Greedy from [11] is 342 x6 then 257...: with pad == stop == 257 the row keeps its 257 and
    nothing after it; other rows (left-padded with 257) and a prompt containing 257 are unaffected."""
    params = SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=[257])
    pad_is_eos = HFRolloutEngine(model, [257], pad_token_id=257)
    prompts = PROMPTS + [[5, 257, 9]]
    got = pad_is_eos.generate(prompts, params)
    ref = engine.generate(prompts, params)  # pad 0
    assert got[1][0].output_token_ids == [342] * 6 + [257]
    assert got[1][0].finish_reason == "stop"
    for g, r in zip(got, ref):
        assert g[0].output_token_ids == r[0].output_token_ids and g[0].finish_reason == r[0].finish_reason
    # default stop ids (None) = the engine's eos ids
    assert (pad_is_eos.generate([[11]],
                                SamplingParams(temperature=0, max_new_tokens=10))[0][0].output_token_ids[-1]
            == 257)


def test_default_eos_ids_from_tokenizer_and_generation_config(model, tokenizer):
    assert resolve_eos_ids(tokenizer, model) == [2, 0]  # tokenizer eos 2 + generation config [2, 0]
    assert resolve_eos_ids([7, 7, 9]) == [7, 9] and resolve_eos_ids(5) == [5]
    with pytest.raises(ValueError, match="tokenizer_or_eos_ids"):
        resolve_eos_ids([1, -3])


def test_seeding(engine):
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=11)
    tokens = lambda outs: [o.output_token_ids for g in outs for o in g]  # noqa: E731
    a, b = engine.generate(PROMPTS, params), engine.generate(PROMPTS, params)
    assert tokens(a) == tokens(b)
    assert [o.logprobs for g in a for o in g] == [o.logprobs for g in b for o in g]
    assert tokens(engine.generate(PROMPTS,
                                  SamplingParams(temperature=1.0, max_new_tokens=8, n=2,
                                                 seed=12))) != tokens(a)
    # seed None: drawn from torch's global RNG, so the training seed decides the rollouts
    unseeded = SamplingParams(temperature=1.0, max_new_tokens=8)
    torch.manual_seed(0)
    first, second = tokens(engine.generate(PROMPTS, unseeded)), tokens(engine.generate(PROMPTS, unseeded))
    torch.manual_seed(0)
    assert tokens(engine.generate(PROMPTS, unseeded)) == first != second
    torch.manual_seed(1)
    assert tokens(engine.generate(PROMPTS, unseeded)) != first


def test_n_samples_are_group_contiguous(engine):
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=3, seed=5)
    out = engine.generate(PROMPTS[:2], params)
    assert len(out) == 2 and all(len(g) == 3 for g in out)
    assert all(o.prompt_token_ids == PROMPTS[p] for p, g in enumerate(out) for o in g)
    assert len({tuple(o.output_token_ids) for o in out[0]}) == 3  # n distinct samples
    # group g holds prompt g's samples in sample order: each prompt alone, with its seed, gives them
    for g, prompt in enumerate(PROMPTS[:2]):
        alone = engine.generate([prompt], params, seeds=[rank_seed(5, 0, g)])[0]
        assert [o.output_token_ids for o in alone] == [o.output_token_ids for o in out[g]]


def test_restores_modes_and_leaves_no_gradients(model, engine):
    seen = []
    hook = model.register_forward_pre_hook(lambda m, args: seen.append((m.training, torch.is_grad_enabled())))
    model.train()
    model.model.layers[0].eval()  # a mixed state must come back exactly
    before = {name: m.training for name, m in model.named_modules()}
    try:
        out = engine.generate(PROMPTS[:2], SamplingParams(max_new_tokens=4, seed=0))
    finally:
        hook.remove()
    assert seen and all(mode == (False, False) for mode in seen)  # eval, no_grad during rollout
    assert {name: m.training for name, m in model.named_modules()} == before
    assert all(p.grad is None for p in model.parameters())
    assert all(isinstance(x, float) for g in out for o in g for x in o.logprobs)
    model.eval()


def test_shared_module_and_load_weights(tiny_model_dir, model):
    other = load_causal_lm(tiny_model_dir, dtype="fp32")
    engine = HFRolloutEngine(other, [2], pad_token_id=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=9)
    before = engine.generate(PROMPTS[:1], params)
    with torch.no_grad():  # a "training step" on the shared module changes the rollouts directly
        other.lm_head.weight.mul_(3.0)
    engine.sync_weights(other)  # no-op: same module
    changed = engine.generate(PROMPTS[:1], params)
    assert changed[0][0].logprobs != before[0][0].logprobs
    engine.load_weights(model)  # copy the reference weights back in
    assert torch.equal(other.lm_head.weight, model.lm_head.weight)
    assert engine.generate(PROMPTS[:1], params)[0][0].logprobs == before[0][0].logprobs
    engine.load_weights(model.state_dict())
    with pytest.raises(ValueError, match="state dict"):
        engine.load_weights([1, 2])
    engine.sleep()
    engine.wake_up()


def test_bad_inputs(engine, model):
    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] is empty"):
        engine.generate([[1], []], params)
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\] holds 5000"):
        engine.generate([[1, 5000]], params)
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\] must be a list"):
        engine.generate(["hello"], params)
    with pytest.raises(ValueError, match="params must be a SamplingParams"):
        engine.generate([[1]], {"max_new_tokens": 2})
    with pytest.raises(ValueError, match="pad_token_id"):
        HFRolloutEngine(model, [2], pad_token_id=None)
    with pytest.raises(ValueError, match="batch_size"):
        HFRolloutEngine(model, [2], pad_token_id=0, batch_size=0)
    assert engine.generate([], params) == []


def test_factory(model):
    engine = make_rollout_engine("hf", model, [2], pad_token_id=0)
    assert isinstance(engine, HFRolloutEngine) and isinstance(engine, RolloutEngine)
    with pytest.raises(ValueError, match=r"kind='sglang': valid values are \['hf', 'vllm'\]"):
        make_rollout_engine("sglang", model)


def test_accepts_numpy_and_tensor_prompts(engine):
    import numpy as np

    params = SamplingParams(temperature=0, max_new_tokens=3)
    ref = engine.generate([PROMPTS[0]], params)[0][0]
    for prompt in (np.array(PROMPTS[0]), torch.tensor(PROMPTS[0])):
        out = engine.generate([prompt], params)[0][0]
        assert out.output_token_ids == ref.output_token_ids
        assert out.prompt_token_ids == PROMPTS[0] and all(type(t) is int for t in out.prompt_token_ids)


def test_works_on_a_gradient_checkpointed_training_model(tiny_model_dir, engine):
    ckpt = load_causal_lm(tiny_model_dir, dtype="fp32", gradient_checkpointing=True).train()
    params = SamplingParams(temperature=0.7, max_new_tokens=6, n=2, seed=3)
    # same stop ids
    got = HFRolloutEngine(ckpt, engine.eos_token_ids, pad_token_id=0).generate(PROMPTS, params)
    ref = engine.generate(PROMPTS, params)
    assert [o.output_token_ids for g in got for o in g] == [o.output_token_ids for g in ref for o in g]
    assert ckpt.training


def test_per_prompt_budgets(engine):
    """`max_new_tokens` per prompt (OpenRLHF's max_len - len(prompt) when --rollout.max_new_tokens is
    unset): each sample stops at its own budget with "length"; greedy tokens equal an unbounded run's
    prefix, so a short budget elsewhere in the batch changes nothing else."""
    params = SamplingParams(temperature=0, max_new_tokens=10, stop_token_ids=[])
    full = engine.generate(PROMPTS, params)
    cut = engine.generate(PROMPTS, params, max_new_tokens=[3, 10, 1, 7])
    for budget, (a,), (b,) in zip([3, 10, 1, 7], full, cut):
        assert len(b.output_token_ids) == budget and b.finish_reason == "length"
        assert b.output_token_ids == a.output_token_ids[:budget]
        assert b.logprobs == pytest.approx(a.logprobs[:budget], abs=1e-5)
    with pytest.raises(ValueError, match="3 entries for 4 prompts"):
        engine.generate(PROMPTS, params, max_new_tokens=[1, 2, 3])
    with pytest.raises(ValueError, match="integer >= 1"):
        engine.generate(PROMPTS, params, max_new_tokens=[1, 0, 3, 4])


@pytest.mark.parametrize("fast_decode", [True, False])
def test_the_samples_of_a_prompt_share_one_prefill_row(model, tokenizer, fast_decode):
    """n = 3 samples of 2 prompts: the prefill forward holds 2 rows (each prompt once), its cache and
    logits are copied to the 3 samples, and every sampled token's log-prob is the teacher-forced one."""
    engine = HFRolloutEngine(model, tokenizer, pad_token_id=tokenizer.pad_token_id, fast_decode=fast_decode)
    rows, inner = [], engine._forward

    def spy(input_ids, *args):
        rows.append(tuple(input_ids.shape))
        return inner(input_ids, *args)

    engine._forward = spy
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12]]
    outputs = engine.generate(prompts, SamplingParams(temperature=1.0, n=3, seed=4, max_new_tokens=6,
                                                      stop_token_ids=[]))
    assert rows[0] == (2, 6) and rows[1][0] == 6  # one prefill row per prompt, then 6 decode rows
    flat = [o for group in outputs for o in group]
    assert len({tuple(o.output_token_ids) for o in flat}) > 2  # the copies sample independently
    for out, ref in zip(flat, recomputed_logprobs(model, flat, 1.0)):
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=1e-5, rtol=0)


def test_generate_inside_paused_on_the_same_thread(engine):
    """The thread that holds the engine (`paused`, as a weight sync does) may still generate: the decode
    loop waits for loads from other threads only, never for itself."""
    import threading

    out = {}

    def run():
        with engine.paused():
            out["o"] = engine.generate([[5, 6]],
                                       SamplingParams(temperature=0, max_new_tokens=3, stop_token_ids=[]))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive() and len(out["o"][0][0].output_token_ids) == 3
