"""`posttrain ppo`'s on-policy distillation flags: --teacher.* and --algo.teacher_coef (config/roles.py,
config/ppo_rules.py), and the teacher's vocabulary check before any model loads (trainers/rl/build.py)."""
import json
import shutil

import pytest
from config_args import BASE

from posttrain.config import ConfigError, parse_config
from posttrain.config.ray_mode import run_roles


def _problems(*argv):
    with pytest.raises(ConfigError) as err:
        parse_config("ppo", list(argv), device="cpu")
    return err.value.problems


def _without_reward():
    ppo = list(BASE["ppo"])
    i = ppo.index("--reward.remote_url")
    return ppo[:i] + ppo[i + 2:]


def test_a_teacher_is_a_reward_source_of_its_own_and_a_role():
    cfg = parse_config("ppo", _without_reward() + ["--teacher.model_name_or_path", "t"], device="cpu")
    assert cfg.algo.teacher_coef is None and run_roles(cfg).has("teacher")
    assert not run_roles(parse_config("ppo", BASE["ppo"], device="cpu")).has("teacher")


def test_teacher_coef_needs_a_teacher_and_is_not_negative():
    assert _problems(*BASE["ppo"], "--algo.teacher_coef", "0.5") == [
        "--algo.teacher_coef 0.5: weighs the on-policy distillation term, which needs a teacher: add "
        "--teacher.model_name_or_path (or drop the flag)"]
    found = _problems(*BASE["ppo"], "--teacher.model_name_or_path", "t", "--algo.teacher_coef", "-1")
    assert found == ["--algo.teacher_coef -1.0: must be a finite number >= 0"]


def test_the_cli_refuses_them_with_one_line_and_exit_2(capsys):
    from posttrain.cli import train_ppo_ray

    with pytest.raises(SystemExit) as ended:
        train_ppo_ray.main(BASE["ppo"] + ["--algo.teacher_coef", "1"])
    assert ended.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--algo.teacher_coef 1.0" in err[0] and "--teacher.model_name_or_path" in err[0]


def test_a_teacher_of_another_vocabulary_is_refused(tiny_model_dir, tmp_path):
    from posttrain.models import load_tokenizer
    from posttrain.trainers.rl.build import check_teacher_vocabulary

    tokenizer = load_tokenizer(tiny_model_dir)
    same = parse_config("ppo", BASE["ppo"] + ["--teacher.model_name_or_path", tiny_model_dir], device="cpu")
    check_teacher_vocabulary(same, tokenizer)  # the policy's own folder: accepted
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    extended = load_tokenizer(str(other))
    extended.add_tokens(["<a-token-the-policy-lacks>"])
    extended.save_pretrained(other)
    cfg = parse_config("ppo", BASE["ppo"] + ["--teacher.model_name_or_path", str(other)], device="cpu")
    with pytest.raises(ConfigError, match=r"^--teacher.model_name_or_path .*another vocabulary"):
        check_teacher_vocabulary(cfg, tokenizer)
    small = tmp_path / "small"  # no tokenizer files: the embedding rows are checked
    small.mkdir()
    config = json.loads((other / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": len(tokenizer) - 1}))
    cfg = parse_config("ppo", BASE["ppo"] + ["--teacher.model_name_or_path", str(small)], device="cpu")
    with pytest.raises(ConfigError, match=f"vocabulary of {len(tokenizer) - 1} tokens"):
        check_teacher_vocabulary(cfg, tokenizer)


def test_a_teacher_only_run_with_an_eval_set_is_warned_that_its_eval_rewards_read_0():
    from posttrain.config import ConfigWarning

    teacher = ["--teacher.model_name_or_path", "t", "--eval.dataset", "e.jsonl"]
    with pytest.warns(ConfigWarning, match="--eval.dataset e.jsonl: this run has no task reward"):
        parse_config("ppo", _without_reward() + teacher, device="cpu")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        parse_config("ppo", BASE["ppo"] + teacher, device="cpu")  # with a task reward: no warning


def test_a_teacher_only_run_refuses_dynamic_filtering():
    """No task reward: every score is 0 and dynamic filtering would drop every group."""
    teacher = ["--teacher.model_name_or_path", "t", "--algo.dynamic_filtering_enable",
               "--rollout.n_samples_per_prompt", "2"]
    found = _problems(*_without_reward(), *teacher)
    assert len(found) == 1
    assert found[0].startswith("--algo.dynamic_filtering_enable: filters groups by their task rewards")
    parse_config("ppo", BASE["ppo"] + teacher, device="cpu")  # with a task reward: accepted


def test_a_teacher_with_more_embedding_rows_is_not_refused_by_the_kd_rule(tiny_model_dir, tmp_path):
    """On-policy distillation scores sampled ids: a teacher of the same tokenizer with a larger (padded)
    embedding is fine (the kd rule of equal config.json vocab sizes is kd's alone); kd refuses it."""
    from posttrain.models import load_tokenizer
    from posttrain.trainers.inputs import model_rule_problems, teacher_tokenizer_problem
    from posttrain.trainers.rl.build import check_teacher_vocabulary

    bigger = tmp_path / "bigger"
    shutil.copytree(tiny_model_dir, bigger)
    config = json.loads((bigger / "config.json").read_text())
    (bigger / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 64}))
    cfg = parse_config("ppo", BASE["ppo"] + ["--teacher.model_name_or_path", str(bigger)], device="cpu")
    cfg.actor.model_name_or_path = tiny_model_dir
    assert model_rule_problems(cfg, {tiny_model_dir, str(bigger)}) == []
    tokenizer = load_tokenizer(tiny_model_dir)
    check_teacher_vocabulary(cfg, tokenizer)
    assert teacher_tokenizer_problem(str(bigger), tokenizer, "why") is None
    kd = parse_config("kd", BASE["kd"], device="cpu")
    kd.model.model_name_or_path, kd.teacher.model_name_or_path = tiny_model_dir, str(bigger)
    assert "vocabulary of" in model_rule_problems(kd, {tiny_model_dir, str(bigger)})[0]


def test_kd_names_a_teacher_whose_tokenizer_differs_at_equal_size(tiny_model_dir, tmp_path):
    """Two tokenizers of one size but other tokens (as Llama-2 and Mistral, 32000 each): refused by the
    tokenizer comparison both trainers share."""
    from posttrain.models import load_tokenizer
    from posttrain.trainers.inputs import teacher_tokenizer_problem

    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(k for k in vocab if len(k) > 1)[:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, two ids swapped
    (other / "tokenizer.json").write_text(json.dumps(tok))
    problem = teacher_tokenizer_problem(str(other), load_tokenizer(tiny_model_dir), "use the same tokenizer")
    assert problem.startswith(f"--teacher.model_name_or_path {other}: the teacher's tokenizer has another ")
    assert "\n" not in problem
