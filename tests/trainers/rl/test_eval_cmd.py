"""`posttrain eval` reproduces what `posttrain ppo --eval.dataset` logged for the same checkpoint
(posttrain/cli/evaluate.py over trainers/inference.py and trainers/rl/eval_rollouts.py)."""
import json

import pytest
from rl_runs import ppo_flags


def test_eval_reproduces_the_pass_at_k_ppo_logged_for_its_final_model(rl_setup, tiny_model_dir, tmp_path,
                                                                       capsys):
    from posttrain.cli import evaluate, train_ppo_ray
    from posttrain.utils.metrics import read_metrics

    _, data, rewards = rl_setup
    out = tmp_path / "ppo"
    # the random-weights model: greedy answers that differ from prompt to prompt, scored by their parity
    evaluation = ["--eval.dataset", data, "--eval.split", "test", "--eval.steps", "2",
                  "--eval.n_samples_per_prompt", "2", "--eval.temperature", "0"]
    flags = ppo_flags((tiny_model_dir, data, rewards), out, *evaluation, "--train.max_steps", "2",
                      reward="spread.py")
    final = train_ppo_ray.main(flags)
    logged = {k: v for k, v in final.items() if k.startswith("eval_data_")}
    assert set(logged) == {"eval_data_pass1", "eval_data_pass2", "eval_data_response_length"}
    assert 0 < logged["eval_data_pass1"] < 1  # some samples score 1, some 0: numbers that tell models apart
    before = next(r for r in read_metrics(out / "metrics.jsonl") if r["step"] == 0)
    assert before["eval_data_pass1"] != logged["eval_data_pass1"]  # training changed the greedy answers
    capsys.readouterr()
    got = evaluate.main(["--model.model_name_or_path", str(out), "--data.dataset", str(data), "--data.split",
                         "test", "--data.input_key", "prompt", "--data.label_key", "answer",
                         "--data.apply_chat_template",
                         "--reward.remote_url", str(rewards / "spread.py"), "--rollout.temperature", "0",
                         "--rollout.n_samples_per_prompt", "2", "--rollout.max_new_tokens", "4",
                         "--rollout.engine", "hf", "--output", str(tmp_path / "eval.json")])
    assert got == logged
    assert json.loads((tmp_path / "eval.json").read_text()) == logged
    assert f"eval_data_pass1 {logged['eval_data_pass1']:.6g}" in capsys.readouterr().out


def test_the_math_grader_reward_file_grades_boxed_answers():
    pytest.importorskip("math_verify")
    from posttrain.rewards.examples.math_reward import reward_func

    prompts = ["Q: half?", "Q: two?", "Q: three?"]
    queries = [p + a for p, a in zip(prompts, [" so \\boxed{\\frac{1}{2}}", " \\boxed{3}", " 3"])]
    assert reward_func(queries, prompts, ["0.5", "2", "3"])["rewards"].tolist() == [1.0, 0.0, 0.0]
