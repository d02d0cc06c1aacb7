"""`posttrain ppo` end to end: every estimator raises the reward; GSPO and dual-clip train with OpenRLHF's
loss; resume, seeds, evaluation."""
import json
import shutil

import pytest
import torch
from rl_helpers import rewards_by_step

from posttrain.utils.metrics import read_metrics

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("estimator,extra", [
    ("group_norm", []),
    ("dr_grpo", ["--actor.loss_agg", "seq_sum_norm"]),
    ("rloo", []),
    ("reinforce_baseline", []),
    ("reinforce",
     ["--rollout.n_samples_per_prompt", "1", "--rollout.batch_size", "32", "--data.max_samples", "256"]),
    ("gae", ["--critic.adam.lr", "3e-3", "--critic.lr_warmup_ratio", "0"]),
])
def test_each_estimator_raises_the_reward(run_ppo, estimator, extra):
    out, _ = run_ppo("--algo.advantage.estimator", estimator, *extra, "--train.num_episodes", "1",
                     name=estimator)
    r = rewards_by_step(out)
    assert len(r) == 8
    first, last = sum(r[:2]) / 2, sum(r[-2:]) / 2
    assert last > first + 0.15, (estimator, r)
    rows = read_metrics(out / "metrics.jsonl")
    assert all(row["rollout/logprob_abs_gap"] < 1e-4 for row in rows)  # rollout == training log-probs
    for key in ("reward/std", "response/length", "response/truncated_frac", "actor/clip_ratio",
                "actor/grad_norm", "timing/generation", "timing/make_experience", "timing/ppo_train",
                "timing/step_total"):
        assert key in rows[0], key
    if estimator == "gae":
        assert "critic/value_loss" in rows[0]


@pytest.fixture
def policy_loss_calls(monkeypatch):
    """Every `policy_loss` call of the actor update during a run (inputs, keywords, the loss and metrics it
    returned); the real function computes them."""
    import posttrain.trainers.rl.updates as updates

    calls, real = [], updates.policy_loss

    def recorded(logp, old_logp, advantages, mask, **kw):
        loss, metrics = real(logp, old_logp, advantages, mask, **kw)
        calls.append({"logp": logp.detach().clone(), "old": old_logp.detach().clone(),
                      "adv": advantages.clone(), "mask": mask.clone(), "kw": kw, "loss": loss.detach(),
                      "metrics": metrics})
        return loss, metrics
    monkeypatch.setattr(updates, "policy_loss", recorded)
    return calls


def openrlhf_policy_loss(call, kind, dual_clip=None, eps=0.2):
    """OpenRLHF 0.10.2's PolicyLoss (openrlhf/models/loss.py, no IS correction) on one recorded micro-batch:
    (loss, clip fraction, dual-clip fraction). `kind` "gspo": the ratio is exp of the sequence's mean
    log-ratio and the loss a mean over sequences of token means; "ppo": token ratios, one token mean."""
    m = call["mask"].float()
    log_ratio = call["logp"] - call["old"]
    adv = call["adv"] * m
    if kind == "gspo":
        ratio = ((log_ratio * m).sum(-1) / m.sum(-1)).exp()[:, None] * m
    else:
        ratio = log_ratio.exp()
    surr1, surr2 = ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv
    objective = torch.min(surr1, surr2)
    floored = torch.zeros_like(m)
    if dual_clip is not None:
        floored = ((adv < 0) & (dual_clip * adv > objective)).float()
        objective = torch.where(adv < 0, torch.max(objective, dual_clip * adv), objective)
    loss = -objective * m
    mean = (loss.sum(-1) / m.sum(-1)).mean() if kind == "gspo" else loss.sum() / m.sum()
    token_frac = lambda t: float((t * m).sum() / m.sum())
    return float(mean), token_frac((surr2 < surr1).float()), token_frac(floored)


# 2 optimizer steps per rollout (the second one off-policy), one micro-batch each
OFF_POLICY = ("--algo.advantage.estimator", "group_norm", "--train.num_episodes", "1",
              "--train.batch_size", "16", "--train.micro_batch_size", "16")


def test_gspo_trains_with_openrlhfs_sequence_ratio(run_ppo, policy_loss_calls):
    """Every loss the actor backpropagates is OpenRLHF's GSPO loss of its batch (sequence ratio, clipped per
    sequence, mean of token means), not the token-level one, and the reward rises."""
    out, _ = run_ppo(*OFF_POLICY, "--actor.policy_loss_type", "gspo", "--actor.eps_clip", "0.05", name="gspo")
    assert len(policy_loss_calls) == 16  # 8 rollouts x 2 optimizer steps x 1 micro-batch
    differs_from_token_level = clipped = 0
    for call in policy_loss_calls:
        assert (call["kw"]["loss_type"], call["kw"]["agg"]) == ("gspo", "seq_mean_token_mean")
        loss, clip_frac, _ = openrlhf_policy_loss(call, "gspo", eps=0.05)
        assert float(call["loss"]) == pytest.approx(loss, rel=1e-5, abs=1e-6)
        assert float(call["metrics"]["clip_ratio"]) == pytest.approx(clip_frac, abs=1e-6)
        token_level, _, _ = openrlhf_policy_loss(call, "ppo", eps=0.05)
        differs_from_token_level += abs(token_level - loss) > 1e-4
        clipped += clip_frac > 0
    assert differs_from_token_level >= 4 and clipped >= 2, (differs_from_token_level, clipped)
    rows = read_metrics(out / "metrics.jsonl")
    assert any(r["actor/clip_ratio"] > 0 for r in rows)
    r = rewards_by_step(out)
    assert sum(r[-2:]) / 2 > sum(r[:2]) / 2 + 0.15, r


def test_dual_clip_bounds_the_loss_of_negative_advantages(run_ppo, policy_loss_calls):
    """With --actor.dual_clip c, the loss of a token with a negative advantage is at most -c·Â (OpenRLHF's
    dual-clip PPO): some tokens hit the bound, the logged dual-clip fraction says how many, every loss is
    OpenRLHF's, and the reward rises."""
    out, _ = run_ppo(*OFF_POLICY, "--actor.dual_clip", "1.05", name="dual_clip")
    assert len(policy_loss_calls) == 16
    floored_calls = 0
    for call in policy_loss_calls:
        assert call["kw"]["dual_clip"] == 1.05
        loss, clip_frac, dual_frac = openrlhf_policy_loss(call, "ppo", dual_clip=1.05)
        assert float(call["loss"]) == pytest.approx(loss, rel=1e-5, abs=1e-6)
        assert float(call["metrics"]["clip_ratio"]) == pytest.approx(clip_frac, abs=1e-6)
        assert float(call["metrics"]["dual_clip_frac"]) == pytest.approx(dual_frac, abs=1e-6)
        if dual_frac > 0:
            floored_calls += 1
            assert loss < openrlhf_policy_loss(call, "ppo")[0] - 1e-6  # the bound lowers the loss
    assert floored_calls >= 2, floored_calls
    assert max(row["actor/dual_clip_frac"] for row in read_metrics(out / "metrics.jsonl")) > 0
    r = rewards_by_step(out)
    assert sum(r[-2:]) / 2 > sum(r[:2]) / 2 + 0.15, r


def test_trl_rloo_flags_train(run_ppo):
    """TRL RLOO semantics end to end (rloo, sequence-level KL, missing-EOS penalty, batch-normalised
    rewards, sequence-level advantage whitening, the sequence-sum ratio loss): the penalty hits exactly the
    samples the engine did not stop at an EOS (here the truncated ones), and the score rises."""
    out, _ = run_ppo("--algo.advantage.estimator", "rloo", "--algo.kl.sequence_level_enable",
                     "--algo.kl.init_coef", "0.01", "--reward.missing_eos_penalty", "0.5",
                     "--reward.batch_normalize_enable", "--algo.advantage.whiten_enable",
                     "--algo.advantage.whiten_level", "sequence", "--actor.policy_loss_type", "seq_sum",
                     "--train.num_episodes", "1", name="trl_rloo")
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "reward/mean" in r]
    assert len(rows) == 8
    for row in rows:
        assert row["shaping/penalised_frac"] == pytest.approx(row["response/truncated_frac"])
        assert row["reward/mean"] == pytest.approx(row["score/mean"] - 0.5 * row["response/truncated_frac"],
                                                   abs=1e-6)
    assert 0 < sum(r["response/truncated_frac"] for r in rows) < len(rows)
    scores = [r["score/mean"] for r in rows]
    assert sum(scores[-2:]) / 2 > sum(scores[:2]) / 2 + 0.15, scores


def test_kl_reward_and_loss_and_reference(run_ppo):
    out, _ = run_ppo("--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0.05",
                     "--algo.kl.estimator", "k3", "--train.num_episodes", "2", name="kl_reward")
    rows = read_metrics(out / "metrics.jsonl")
    assert rows[0]["kl/mean"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first update
    assert rows[-1]["kl/mean"] > 0 and rows[-1]["kl/coef"] == pytest.approx(0.05)
    out, _ = run_ppo("--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0.05",
                     "--algo.kl.use_loss", "--algo.kl.estimator", "k2", "--algo.kl.target", "0.01",
                     "--train.num_episodes", "2", name="kl_loss")
    rows = read_metrics(out / "metrics.jsonl")
    assert "actor/kl_loss" in rows[-1]
    assert rows[-1]["kl/coef"] != pytest.approx(0.05)  # the adaptive controller moved


def test_eval_pass_at_k_and_the_last_step_is_evaluated(run_ppo, rl_setup):
    _, data, _ = rl_setup
    out, final = run_ppo("--eval.dataset", data, "--eval.split", "test", "--eval.steps", "3",
                         "--eval.n_samples_per_prompt", "3", "--eval.temperature", "1.0",
                         "--train.num_episodes", "1", name="eval", reward="correct.py")
    assert set(final) >= {"eval_data_pass1", "eval_data_pass3"}
    assert final["eval_data_pass3"] >= final["eval_data_pass1"]
    # the starting model (the best model's baseline), every 3 steps, and the last of the 8 steps
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if "eval_data_pass1" in r] == [0, 3, 6, 8]
    assert (out / "samples.jsonl").read_text().count("\n") == 8 * 4  # 8 steps, 4 samples each


def test_best_checkpoint_is_resumable_with_ema_weights_and_hf_exports_outlive_rotation(run_ppo, rl_setup):
    from safetensors.torch import load_file

    from posttrain.utils.checkpoint import read_manifest, verify_checkpoint

    _, data, _ = rl_setup
    out, _ = run_ppo("--eval.dataset", data, "--eval.split", "test", "--eval.steps", "3",
                     "--eval.n_samples_per_prompt", "1", "--train.num_episodes", "1", "--train.enable_ema",
                     "--ckpt.save_steps", "2", "--ckpt.max_num", "1", "--ckpt.save_hf", name="best",
                     reward="rising.py")
    ck = out / "checkpoints"
    # every --ckpt.save_hf export is kept; rotation keeps one regular checkpoint and the best one
    assert sorted(p.name for p in ck.iterdir() if not p.name.startswith(".")) == [
        "best_global_step8", "global_step2_hf", "global_step4_hf", "global_step6_hf", "global_step8",
        "global_step8_hf"]
    best = ck / "best_global_step8"  # every evaluation beat the earlier ones: the last is the best
    assert verify_checkpoint(best) is None
    assert (best / "trainer_state.pt").exists() and (best / "actor").is_dir()
    meta = read_manifest(best)["meta"]
    assert meta["global_step"] == 8 and meta["best"]["key"] == "eval_data_pass1" and meta["best"]["step"] == 8
    assert json.loads((out / "best" / "best_metric.json").read_text())["step"] == 8
    final, best_copy = (load_file(str(d / "model.safetensors")) for d in (out, out / "best"))
    assert all(torch.equal(final[k], best_copy[k]) for k in final)  # both the EMA weights of step 8


def test_no_best_model_when_the_evaluation_never_improves(run_ppo, rl_setup, capsys):
    _, data, _ = rl_setup
    out, _ = run_ppo("--eval.dataset", data, "--eval.split", "test", "--eval.steps", "1",
                     "--eval.n_samples_per_prompt", "1", "--train.max_steps", "2", "--ckpt.save_steps", "1",
                     name="flat", reward="zero.py")
    assert not (out / "best").exists() and not list((out / "checkpoints").glob("best*"))
    assert "no improvement: eval_data_pass1 never rose above the starting model's 0.0000 (step 0)" in \
        capsys.readouterr().err


def test_resume_reproduces_uninterrupted_rl_run(run_ppo, tmp_path):
    flags = ["--algo.advantage.estimator", "gae", "--train.num_episodes", "1", "--ckpt.save_steps", "2",
             "--ckpt.max_num", "4", "--train.enable_ema", "--algo.kl.init_coef", "0.01"]
    full, _ = run_ppo(*flags, "--ckpt.path", tmp_path / "ck_full", name="full")
    ck = tmp_path / "ck_resume"
    ck.mkdir()
    shutil.copytree(tmp_path / "ck_full" / "global_step4", ck / "global_step4")
    resumed, _ = run_ppo(*flags, "--ckpt.path", ck, "--ckpt.load_enable", name="resumed")
    assert rewards_by_step(resumed, start=5) == pytest.approx(rewards_by_step(full)[4:], abs=1e-6)
    from safetensors.torch import load_file

    a, b = load_file(str(full / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=0)


def test_different_seed_gives_different_rollouts(run_ppo):
    """Two steps each: the second step's rollouts come from weights the first step trained."""
    short = ("--train.num_episodes", "1", "--data.max_samples", "16")
    a, _ = run_ppo(*short, "--train.seed", "1", name="s1")
    b, _ = run_ppo(*short, "--train.seed", "2", name="s2")
    c, _ = run_ppo(*short, "--train.seed", "1", name="s1_again")
    samples = lambda d: (d / "samples.jsonl").read_text()
    # 4 logged per step
    assert [json.loads(line)["step"] for line in samples(a).splitlines()] == [1] * 4 + [2] * 4
    assert samples(a) == samples(c)
    assert samples(a) != samples(b)


def test_one_process_says_which_engine_samples_and_why(run_ppo, capsys):
    """Without --vllm.num_engines the run samples with the HF engine over the actor's module (vLLM was not
    faster in the trainer's process on CPU: bench/RESULTS.md); start-up says so, and how to get vLLM."""
    run_ppo("--train.max_steps", "1", name="engine_line")
    lines = [line for line in capsys.readouterr().err.splitlines() if "rollout engine: " in line]
    assert len(lines) == 1, lines
    assert "posttrain's HF engine, over the actor's own module: no second copy of the weights" in lines[0]
    assert ("one process does not run vLLM" in lines[0] and "--vllm.num_engines N runs vLLM engines on "
                                                            "Ray" in lines[0])

