"""The semantics around the math (docs/algorithms.md, "Semantics around the math"), each a regression
test of a divergence from OpenRLHF 0.10.2 found by a side-by-side reading: every kept row trains,
per-sample generation budgets, OpenRLHF's reward-function inputs, EMA per optimizer step, the
critic's normalisation, the KL statistic, refill seeds, and packed / dynamic batches."""
import numpy as np
import pytest
import torch

from posttrain.data import Prompt
from posttrain.models import load_causal_lm, load_score_model, load_tokenizer
from posttrain.rollout import HFRolloutEngine, RolloutOutput, SamplingParams
from posttrain.rollout.single_turn import Rollout, ScoredRollouts, SingleTurnSampler
from posttrain.trainers.rl.batch_forward import Batching, policy_forward, ppo_batchings, value_forward
from posttrain.trainers.rl.collect import PromptStream, ShapingSettings, collect, shape_rewards
from posttrain.trainers.rl.experience import build_experience
from posttrain.trainers.rl.experience_maker import sequence_mean as _sequence_mean
from posttrain.trainers.rl.roles import Actor, Critic
from posttrain.trainers.rl.updates import UpdateSettings, optimizer_steps, update_actor

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def settings(batch_size, max_epochs=1, **kw) -> UpdateSettings:
    base = dict(batch_size=batch_size, batching=Batching(8), max_epochs=max_epochs, loss_agg="token_mean",
                max_len=8, eps_low=0.2, eps_high=0.2, dual_clip=None, policy_loss_type="ppo",
                entropy_coef=None, kl_use_loss=False, kl_estimator="k1", is_correction=None,
                is_threshold=(0.5, 5.0), value_clip=None, seed=0)
    base.update(kw)
    return UpdateSettings(**base)


@pytest.mark.parametrize("rows,batch,expected", [(120, 128, [120]), (96, 64, [64, 32]), (128, 64, [64, 64])])
def test_every_kept_row_trains(rows, batch, expected):
    """Dynamic filtering kept 120 rows with --train.batch_size 128: one step of 120 rows (no step
    before); 96 rows with batch 64: 64 + 32 (32 rows were dropped before)."""
    steps = list(optimizer_steps(rows, settings(batch, max_epochs=2), step=3))
    assert [len(s) for s in steps] == expected * 2
    for epoch in (steps[:len(expected)], steps[len(expected):]):
        assert sorted(np.concatenate(epoch).tolist()) == list(range(rows))


# ---- executor: budgets and reward inputs -------------------------------------------------------------------
@pytest.fixture(scope="module")
def nano(tiny_model_dir):
    return load_causal_lm(tiny_model_dir), load_tokenizer(tiny_model_dir)


def test_each_sample_gets_its_own_budget(nano):
    """--rollout.max_new_tokens unset: max_len - len(its prompt) per sample (OpenRLHF); a long prompt
    no longer shortens every other sample's response."""
    model, tok = nano

    class Count:
        def score(self, queries, prompts, labels):
            from posttrain.rewards import RewardResult
            return RewardResult(torch.zeros(len(queries)))

    executor = SingleTurnSampler(HFRolloutEngine(model, tok, pad_token_id=tok.pad_token_id), Count(), tok)
    prompts = [Prompt("", [5, 6, 7], None, "a"), Prompt("", list(range(10, 40)), None, "b")]
    params = SamplingParams(temperature=1.0, max_new_tokens=37, n=2, seed=1, stop_token_ids=[])
    out = executor.run(prompts, params, max_len=40)
    assert [len(r.output_ids) for r in out.rollouts] == [37, 37, 10, 10]
    assert [r.budget for r in out.rollouts] == [37, 37, 10, 10]
    assert all(r.finish_reason == "length" for r in out.rollouts)


def test_overlong_penalty_reads_each_samples_budget():
    rolls = [Rollout([1], [2] * 90, [0.0] * 90, "length", "", "", budget=100),
             Rollout([1] * 50, [2] * 45, [0.0] * 45, "length", "", "", budget=50)]
    batch = ScoredRollouts(rolls, torch.ones(2), torch.ones(2), {}, torch.zeros(2, dtype=torch.bool))
    shape_rewards(batch, ShapingSettings(overlong_buffer_len=20.0, overlong_penalty_factor=1.0,
                                         stop_properly_penalty_coef=None))
    assert batch.rewards.tolist() == pytest.approx([0.5, 0.25])


class FixedEngine:
    """Returns the same outputs for every prompt: one finished with EOS, one truncated."""

    def __init__(self, outputs):
        self.outputs = outputs

    def generate(self, prompt_token_ids, params, max_new_tokens=None):
        return [[RolloutOutput(list(p), o, [0.0] * len(o), "stop" if i == 0 else "length")
                 for i, o in enumerate(self.outputs)] for p in prompt_token_ids]


def test_reward_function_sees_openrlhf_queries_with_the_eos(tmp_path, nano):
    """`queries` = decode(prompt ids + response ids, skip_special_tokens=False), as OpenRLHF: a
    format check can tell the finished answer (ends in EOS) from the truncated one."""
    from posttrain.rewards import PythonRewardFunction

    _, tok = nano
    (tmp_path / "eos.py").write_text(
        "SEEN = []\n"
        "def reward_func(queries, prompts, labels):\n"
        "    SEEN.extend(queries)\n"
        f"    return [1.0 if q.endswith({tok.eos_token!r}) else 0.0 for q in queries]\n")
    source = PythonRewardFunction(str(tmp_path / "eos.py"))
    prompt_text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                          add_generation_prompt=True)
    prompt = Prompt(prompt_text, tok(prompt_text, add_special_tokens=False)["input_ids"], "5", "row 1")
    answer = tok("5", add_special_tokens=False)["input_ids"]
    executor = SingleTurnSampler(FixedEngine([answer + [tok.eos_token_id], answer + answer]), source, tok)
    out = executor.run([prompt], SamplingParams(n=2, max_new_tokens=4))
    assert out.rewards.tolist() == [1.0, 0.0]
    seen = source.fn.__globals__["SEEN"]
    assert seen == [prompt_text + "5" + tok.eos_token, prompt_text + "55"]


# ---- roles: EMA, critic normalisation, packing ------------------------------------------------------------
def experience(tok, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    rolls = []
    for i in range(n):
        p = torch.randint(3, 300, (3 + i % 3,), generator=g).tolist()
        o = torch.randint(3, 300, (2 + (i * 2) % 5,), generator=g).tolist()
        rolls.append(Rollout(p, o, [-1.0] * len(o), "length", "", ""))
    exp = build_experience(rolls, torch.zeros(n), tok.pad_token_id)
    exp.advantages = torch.randn(exp.action_mask.shape, generator=g) * exp.action_mask
    return exp


class RecordingEngine:
    """A plain SGD step on the actor (so the test sees each optimizer step's weights)."""

    def __init__(self, model):
        self.model, self.module, self.steps, self.lr = model, model, [], 0.1

    def backward(self, loss):
        loss.backward()

    def all_reduce(self, tensor, op="sum"):  # one process (the TrainEngine contract)
        return tensor

    def max_across_ranks(self, value):
        return value

    def step(self):
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    p -= self.lr * p.grad
                    p.grad = None
        self.steps.append({k: v.detach().clone().float() for k, v in self.model.state_dict().items()})
        return 0.0


def test_ema_updates_once_per_optimizer_step(tiny_model_dir):
    """--train.ema_beta means what it means in OpenRLHF: ema ← β·ema + (1-β)·θ after every
    optimizer step (here 3 per rollout: 6 rows, batch 2), not once per RL step."""
    model, tok = load_causal_lm(tiny_model_dir), load_tokenizer(tiny_model_dir)
    init = {k: v.detach().clone().float() for k, v in model.state_dict().items()}
    engine = RecordingEngine(model)
    actor = Actor(model, engine, 1.0, torch.device("cpu"), ema_beta=0.9)
    update_actor(actor, experience(tok), settings(2), 0.0, step=0)
    assert len(engine.steps) == 3
    for k in init:
        expected = init[k]
        for weights in engine.steps:
            expected = 0.9 * expected + 0.1 * weights[k]
        torch.testing.assert_close(actor.ema[k], expected, atol=1e-6, rtol=0)


def test_critic_from_a_normalised_reward_model_uses_its_mean_and_std(tiny_score_model_dir, tiny_model_dir):
    """OpenRLHF's critic normalises its values with the reward model's stored mean/std under
    --reward.normalize_enable; a critic without them (started from the actor) is unchanged."""
    model = load_score_model(tiny_score_model_dir)
    model.config.mean, model.config.std = 2.0, 4.0
    tok = load_tokenizer(tiny_model_dir)
    exp = experience(tok)
    raw = value_forward(model, exp)
    engine = RecordingEngine(model)
    normalised = Critic(model, engine, torch.device("cpu"), normalize=True).forward(exp)
    torch.testing.assert_close(normalised, (raw - 2.0) / 4.0)
    torch.testing.assert_close(Critic(model, engine, torch.device("cpu"), normalize=False).forward(exp), raw)


def test_packed_and_dynamic_batches_equal_padded(tiny_model_dir, tiny_score_model_dir):
    """--ds.packing_samples and --train.dynamic_batch_enable in the RL passes: log-probs, entropy,
    values and the accumulated policy gradient equal the padded micro-batch computation."""
    model, tok = load_causal_lm(tiny_model_dir), load_tokenizer(tiny_model_dir)
    exp = experience(tok, n=7, seed=3)
    mask = exp.action_mask
    lp, ent = policy_forward(model, exp, 0.7, with_entropy=True)
    lp_p, ent_p = policy_forward(model, exp, 0.7, with_entropy=True, packed=True)
    torch.testing.assert_close(lp_p * mask, lp * mask, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_p * mask, ent * mask, atol=1e-5, rtol=0)
    critic = load_score_model(tiny_score_model_dir)
    torch.testing.assert_close(value_forward(critic, exp, packed=True) * mask,
                               value_forward(critic, exp) * mask, atol=1e-5, rtol=0)

    def grads(batching):
        m = load_causal_lm(tiny_model_dir)
        engine = RecordingEngine(m)
        engine.lr = 0.0  # keep the weights: compare the gradient of the same loss
        captured = {}
        engine.step = lambda: captured.update({k: p.grad.clone() for k, p in m.named_parameters()}) or 0.0
        update_actor(Actor(m, engine, 0.7, torch.device("cpu")), exp, settings(7, batching=batching), 0.0,
                     step=0)
        return captured

    base = grads(Batching(7))
    for batching in (Batching(2), Batching(3, packed=True), Batching(1, max_tokens=24, packed=True),
                     Batching(1, max_tokens=16)):
        other = grads(batching)
        for k in base:
            torch.testing.assert_close(other[k], base[k], atol=2e-6, rtol=1e-4)


@pytest.mark.parametrize("layout,ring,tp", [((), 1, 1), (("--ds.ring_attn_size", "2"), 2, 1),
                                             (("--ds.tensor_parallel_size", "2"), 1, 2),
                                             (("--ds.ring_attn_size", "2", "--ds.tensor_parallel_size", "2"),
                                              2, 2)])
def test_max_tokens_per_gpu_is_per_gpu_of_a_ring_or_tensor_parallel_group(layout, ring, tp):
    """--train / --rollout.max_tokens_per_gpu are budgets per GPU (as OpenRLHF): the micro-batches of the
    training and of the experience-making forwards hold up to budget x ring x TP tokens, the GPUs of the group
    that computes them together; the reference is never split by TP, so its micro-batches hold budget x ring.
    8 rows of 10 tokens; budgets 20 (train) and 10 (rollout)."""
    from posttrain.config import parse_config
    from posttrain.rollout.single_turn import ScoredRollouts
    from posttrain.trainers.rl.experience_maker import ExperienceMaker

    flags = ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "p.jsonl",
             "--reward.remote_url", "r.py", "--ds.packing_samples", "--train.dynamic_batch_enable",
             "--train.max_tokens_per_gpu", "20", "--rollout.max_tokens_per_gpu", "10", "--data.max_len", "16",
             *layout]
    for role in ("actor", "ref", "critic"):
        flags += [f"--{role}.num_gpus_per_node", "4"]
    cfg = parse_config("ppo", flags, device="cpu")
    train, forward, ref = ppo_batchings(cfg, shared=True)
    gpus = ring * tp
    assert (train.max_tokens, forward.max_tokens, ref.max_tokens) == (20 * gpus, 10 * gpus, 10 * ring)
    assert train.packed and train.shared_prefix and forward.packed and ref.packed
    rolls = [Rollout([3, 4, 5, 6], [7 + i] * 6, [-1.0] * 6, "length", "", "") for i in range(8)]
    exp = build_experience(rolls, torch.zeros(8), 0)
    assert [len(m) for m in train.micro_batches(exp)] == [2 * gpus] * (4 // gpus)
    assert [len(m) for m in forward.micro_batches(exp)] == [gpus] * (8 // gpus)

    class Role:  # records the micro-batches each role's forward is given
        def __init__(self):
            self.sizes = []

        def logprobs(self, exp, batching):
            self.sizes += [len(m) for m in batching.micro_batches(exp)]
            return torch.zeros_like(exp.action_mask)

        values = logprobs

    actor, reference, critic = Role(), Role(), Role()
    scored = ScoredRollouts(rolls, torch.zeros(8), torch.zeros(8), {}, torch.zeros(8, dtype=torch.bool))
    ExperienceMaker(cfg, actor, reference, critic, forward, 0, ref).make(scored, kl_coef=0.1)
    assert reference.sizes == [ring] * (8 // ring)
    assert actor.sizes == critic.sizes == [gpus] * (8 // gpus)


def test_kl_statistic_is_per_sequence():
    """OpenRLHF's `kl` (the adaptive controller's input): mean over sequences of each one's token
    mean, so a long sequence does not outweigh a short one."""
    kl = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert _sequence_mean(kl, mask) == pytest.approx(2.0)  # token mean would be 7 / 5 = 1.4


def test_refill_draws_use_their_own_seed():
    """Dynamic filtering refills with fresh prompts; each draw samples with its own seed, so the
    refilled prompts do not replay the first draw's random numbers row for row."""
    seen = []

    class Recorder:
        def run(self, prompts, params, group_offset=0, max_len=None):
            seen.append(params.seed)
            # prompt k of the draw: kept (scores 0, 1: mean 0.5) when k is even, dropped (0, 0) when odd
            scores = torch.tensor([[0.0, 1.0 if k % 2 == 0 else 0.0] for k in range(len(prompts))]).flatten()
            rolls = [Rollout([1], [2], [0.0], "stop", "", "") for _ in range(2 * len(prompts))]
            return ScoredRollouts(rolls, scores, scores, {}, torch.zeros(len(rolls), dtype=torch.bool))

    prompts = [Prompt("", [1], None, str(i)) for i in range(64)]
    collect(Recorder(), prompts, PromptStream(64, 0), SamplingParams(n=2, seed=123), batch_size=4,
            shaping=ShapingSettings(None, 1.0, None), filter_range=(0.0, 1.0), max_extra_draws=16)
    assert len(seen) >= 2 and seen[0] == 123 and len(set(seen)) == len(seen)


# ---- TRL RLOO score pipeline ---------------------------------------------------------------------------
def test_missing_eos_penalty_reads_generated_eos_before_other_shaping():
    """TRL missing_eos_penalty: subtracted from a sample whose generated tokens hold no EOS id (an EOS fed
    by the environment does not count), before the stop-properly penalty scales the truncated reward."""
    rolls = [Rollout([1], [5, 2], [0.0] * 2, "stop", "", ""),
             Rollout([1], [5, 6], [0.0] * 2, "length", "", ""),
             Rollout([1], [5, 7], [0.0] * 2, "stop", "", ""),  # stopped by a non-EOS stop id: penalised
             Rollout([1], [5, 2, 6], [0.0] * 3, "stop", "", "", action_mask=[1, 0, 1])]
    batch = ScoredRollouts(rolls, torch.full((4,), 3.0), torch.ones(4), {}, torch.zeros(4, dtype=torch.bool))
    changed = shape_rewards(batch, ShapingSettings(None, 1.0, 0.5, missing_eos_penalty=1.0, eos_ids=(2, 9)))
    assert batch.rewards.tolist() == [3.0, 1.0, 2.0, 2.0] and changed == 3  # (3 - 1) * 0.5 when truncated


def _trl_maker(*flags):
    from posttrain.config import parse_config
    from posttrain.trainers.rl.experience_maker import ExperienceMaker

    cfg = parse_config("ppo", ["--actor.model_name_or_path", "m", "--data.prompt_dataset", "p.jsonl",
                               "--reward.remote_url", "r.py", "--rollout.batch_size", "2",
                               "--rollout.n_samples_per_prompt", "2", "--train.batch_size", "4",
                               "--algo.advantage.estimator", "rloo", "--algo.kl.init_coef", "0", *flags],
                       device="cpu")
    return ExperienceMaker(cfg, None, None, None, Batching(4), pad_id=0)


@pytest.mark.parametrize("flags,expected", [
    # rewards [1, 2, 2, -1] (after the penalty): mean 1, unbiased std sqrt(2) -> [0, a, a, -2a], a =
    # 1/sqrt(2); rloo with n = 2: [-a, a, 3a, -3a]
    ((), [-0.5 ** 0.5, 0.5 ** 0.5, 3 * 0.5 ** 0.5, -3 * 0.5 ** 0.5]),
    (("--reward.batch_normalize_clip", "1"), [-0.5 ** 0.5, 0.5 ** 0.5, 0.5 ** 0.5 + 1, -0.5 ** 0.5 - 1]),
    # sequence whitening of [-1, 1, 3, -3]·a: mean 0, unbiased std sqrt(20/3)·a
    (("--algo.advantage.whiten_enable", "--algo.advantage.whiten_level", "sequence"),
     [v / (20 / 3) ** 0.5 for v in (-1.0, 1.0, 3.0, -3.0)]),
])
def test_batch_normalised_rewards_and_sequence_whitening_in_the_experience(flags, expected):
    """--reward.batch_normalize_enable normalises the shaped rewards over the batch before the baseline;
    --algo.advantage.whiten_level sequence whitens one advantage per sequence (each row's tokens share it)."""
    rolls = [Rollout([1], o, [0.0] * len(o), "stop", "", "") for o in ([5, 2], [6, 7, 8], [4, 2], [9])]
    scored = ScoredRollouts(rolls, torch.tensor([1.0, 2.0, 2.0, -1.0]), torch.zeros(4), {},
                            torch.zeros(4, dtype=torch.bool))
    exp, _ = _trl_maker("--reward.batch_normalize_enable", *flags).make(scored, 0.0)
    mask = exp.action_mask
    assert mask.sum(1).tolist() == [2, 3, 2, 1]
    per_row = exp.advantages.sum(1) / mask.sum(1)
    torch.testing.assert_close(exp.advantages, per_row[:, None] * mask)
    torch.testing.assert_close(per_row, torch.tensor(expected), rtol=1e-5, atol=1e-6)
