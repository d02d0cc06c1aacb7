"""On-policy distillation in `posttrain ppo` (--teacher.model_name_or_path, --algo.teacher_coef): the teacher
scores every sampled token and `-c * (log pi_old - log pi_teacher)` joins the per-token rewards
(docs/distillation.md)."""
import json

import pytest
import torch


def _rows(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_teacher_with_the_actors_own_weights_gives_a_zero_term_at_step_one(run_ppo, rl_setup):
    sft = rl_setup[0]
    out, _ = run_ppo("--teacher.model_name_or_path", sft, "--algo.teacher_coef", "3",
                     "--train.max_steps", "1", name="self_teacher")
    row = _rows(out)[0]
    assert row["teacher/reverse_kl"] == 0.0  # exactly: the same weights score the same tokens
    assert "reward/mean" in row


def test_an_agent_episodes_action_tokens_get_the_teacher_term_and_its_context_tokens_do_not(rl_setup,
                                                                                           tiny_model_dir):
    """A multi-turn episode keeps the environment's tokens in the sequence, out of its action mask: only the
    sampled tokens are scored (their per-token rewards read from the returns of dr_grpo, gamma 1, no
    whitening, with every task reward 0), checked against a plain forward of both models."""
    from posttrain.config import parse_config
    from posttrain.models import load_causal_lm, load_tokenizer
    from posttrain.rollout.single_turn import Rollout, ScoredRollouts
    from posttrain.trainers.rl import build
    from posttrain.trainers.rl.batch_forward import Batching
    from posttrain.trainers.rl.experience_maker import ExperienceMaker

    sft = str(rl_setup[0])
    cfg = parse_config("ppo", ["--actor.model_name_or_path", sft, "--data.prompt_dataset", "p.jsonl",
                               "--teacher.model_name_or_path", tiny_model_dir, "--algo.teacher_coef", "0.5",
                               "--algo.advantage.estimator", "dr_grpo", "--rollout.n_samples_per_prompt", "2",
                               "--algo.kl.init_coef", "0"], device="cpu")
    tok = load_tokenizer(sft)
    device = torch.device("cpu")
    actor = build.build_actor(cfg, tok, device, total_steps=1)
    teacher = build.build_teacher(cfg, tok, device)
    prompt = tok("What is 2 + 3?", add_special_tokens=False)["input_ids"]
    # an action, two tokens the environment appended, then two more actions
    episode = tok("5 no, again 5", add_special_tokens=False)["input_ids"][:5]
    actions = [1, 0, 0, 1, 1]
    rolls = [Rollout(prompt, episode, [0.0] * 5, "stop", "", "", action_mask=actions, turns=2),
             Rollout(prompt, episode[:2], [0.0] * 2, "stop", "", "")]
    scored = ScoredRollouts(rolls, torch.zeros(2), torch.zeros(2), {}, torch.zeros(2, dtype=torch.bool))
    exp, metrics = ExperienceMaker(cfg, actor, None, None, Batching(4), tok.pad_token_id,
                                   teacher=teacher).make(scored, kl_coef=0.0)

    def sampled_logp(path):
        model = load_causal_lm(path, dtype="fp32").eval()
        ids = torch.tensor([prompt + episode])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        return logp.gather(1, ids[0, 1:, None])[:, 0][len(prompt) - 1:]

    ratio = sampled_logp(sft) - sampled_logp(tiny_model_dir)  # the student's log-ratio at each output token
    assert ratio.abs().min() > 1e-3  # the two models differ at every token, the context's included
    p = len(prompt) - 1
    returns = exp.returns[0, p:p + 5]
    # gamma 1: the return of an action token = its own reward + the next action token's return
    rewards = torch.stack([returns[0] - returns[3], returns[3] - returns[4], returns[4]])
    torch.testing.assert_close(rewards, -0.5 * ratio[[0, 3, 4]], rtol=0, atol=1e-5)
    assert returns[1].item() == returns[2].item() == 0.0  # the environment's tokens: no term, no return
    assert metrics["teacher/reverse_kl"] == pytest.approx(
        float((ratio[[0, 3, 4]].sum() + ratio[:2].sum()) / 5), abs=1e-5)


def held_out_nll(model_dir, rows) -> float:
    """The model's mean NLL per response token (the eos included) of the held-out correct responses, under
    the chat template the runs train with."""
    from posttrain.models import load_causal_lm, load_tokenizer

    model, tok = load_causal_lm(str(model_dir), dtype="fp32").eval(), load_tokenizer(str(model_dir))
    total, count = 0.0, 0
    for row in rows:
        prompt = tok.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                         add_generation_prompt=True)
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        r = tok(row["response"] + tok.eos_token, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([p + r])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        total -= float(logp.gather(1, ids[0, 1:, None])[len(p) - 1:].sum())
        count += len(r)
    return total / count


@pytest.fixture(scope="module")
def weak_student(tiny_model_dir, rl_setup, tmp_path_factory):
    """The nano model after 12 SFT steps (192 of the 360 rows; the teacher, `sft_nano`, had all 360)."""
    from posttrain.cli import train_sft

    out = tmp_path_factory.mktemp("student") / "sft"
    train_sft.main(["--model.model_name_or_path", tiny_model_dir, "--data.dataset", str(rl_setup[1]),
                    "--data.input_key", "prompt", "--data.output_key", "response",
                    "--data.apply_chat_template",
                    "--train.batch_size", "16", "--train.micro_batch_size", "16", "--train.max_epochs", "1",
                    "--data.max_samples", "192", "--adam.lr", "3e-3", "--ckpt.output_dir", str(out),
                    "--data.max_len", "48"])
    return out


@pytest.mark.slow
def test_distilling_from_a_trained_teacher_lowers_the_students_held_out_nll(weak_student, rl_setup, tmp_path):
    """The learning goal: RL steps with the teacher's signal alone (no reward source; reinforce with gamma
    0, Thinking Machines' recipe) bring the student's held-out NLL down. Held-out NLL is the robust measure
    at this scale: the nano teacher answers too few held-out prompts greedily for an accuracy to move."""
    from posttrain.cli import train_ppo_ray

    teacher, data, _ = rl_setup
    out = tmp_path / "opd"
    train_ppo_ray.main(["--actor.model_name_or_path", str(weak_student), "--teacher.model_name_or_path",
                        str(teacher), "--data.prompt_dataset", str(data), "--data.input_key", "prompt",
                        "--data.apply_chat_template", "--data.max_len", "48", "--rollout.batch_size", "8",
                        "--rollout.n_samples_per_prompt", "4", "--rollout.max_new_tokens", "4",
                        "--rollout.micro_batch_size", "32", "--train.batch_size", "32",
                        "--train.micro_batch_size", "32", "--actor.adam.lr", "1e-3",
                        "--actor.lr_warmup_ratio", "0",
                        "--algo.kl.init_coef", "0", "--algo.advantage.estimator", "reinforce",
                        "--algo.advantage.gamma", "0", "--train.max_steps", "8",
                        "--ckpt.output_dir", str(out)])
    rows = [json.loads(line) for line in (data / "test.jsonl").read_text().splitlines()]
    before, after = held_out_nll(weak_student, rows), held_out_nll(out, rows)
    metrics = _rows(out)
    assert all("teacher/reverse_kl" in r for r in metrics) and len(metrics) == 8
    assert after < before - 0.1, (before, after)
