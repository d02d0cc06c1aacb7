"""TensorBoard (`--logger.tensorboard_dir DIR`) from real SFT and PPO runs, read back with TensorBoard's
own reader: each run writes under DIR/<run name> (OpenRLHF's layout: --logger.wandb.run_name, else
`<trainer>_<MMDDTHH:MM>`), and its event files hold every numeric metric of its metrics.jsonl at the same
steps with the same values (TensorBoard stores them as float32)."""
import math
import re
import shutil
from pathlib import Path

import pytest

from posttrain.utils.metrics import read_metrics

pytestmark = pytest.mark.slow


def tensorboard_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} as TensorBoard shows them; a step shown twice under a tag fails."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        steps = [e.step for e in acc.Scalars(tag)]
        assert len(steps) == len(set(steps)), (tag, steps)
        out[tag] = {e.step: e.value for e in acc.Scalars(tag)}
    return out


def jsonl_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for row in read_metrics(run_dir / "metrics.jsonl"):
        for key, value in row.items():
            if key not in ("step", "time") and isinstance(value, (int, float)):
                out.setdefault(key, {})[row["step"]] = value
    return out


def assert_tensorboard_matches_metrics(tb_folder: Path, run_dir: Path) -> dict[str, dict[int, float]]:
    tb, logged = tensorboard_scalars(tb_folder), jsonl_scalars(run_dir)
    assert sorted(tb) == sorted(logged)
    for key, by_step in logged.items():
        assert sorted(tb[key]) == sorted(by_step), key
        for step, value in by_step.items():
            assert math.isclose(tb[key][step], value, rel_tol=1e-6,
                                abs_tol=1e-30), (key, step, tb[key][step], value)
    return logged


def test_sft_runs_sharing_a_tensorboard_dir_each_log_their_metrics(run_sft, tmp_path):
    """Two runs given the same folder (a sweep, say) do not mix: each has its own folder, named as in
    OpenRLHF, that holds exactly its own metrics (mixed in one folder, TensorBoard shows one run with every
    step twice)."""
    tb = tmp_path / "tb"
    first = run_sft("--logger.tensorboard_dir", tb, "--logger.wandb.run_name", "lr_1e-3", "--eval.steps", "2",
                    name="first")
    second = run_sft("--logger.tensorboard_dir", tb, "--adam.lr", "3e-3", name="second")
    named, = [p.name for p in tb.iterdir() if p.name != "lr_1e-3"]
    assert sorted(p.name for p in tb.iterdir()) == sorted(["lr_1e-3", named])
    assert re.fullmatch(r"sft_\d{4}T\d\d:\d\d", named), named
    logged = assert_tensorboard_matches_metrics(tb / "lr_1e-3", first)
    assert sorted(logged["train/loss"]) == list(range(1, 9))
    assert sorted(logged["eval/loss"]) == [2, 4, 6, 8]
    assert assert_tensorboard_matches_metrics(tb / named, second)["train/loss"] != logged["train/loss"]


def test_resumed_run_replaces_the_steps_after_its_checkpoint(run_sft, tmp_path):
    """A run that stopped after step 8 with its last checkpoint at step 4, resumed in the same folders:
    TensorBoard shows each step once, steps 5-8 from the resumed run, as metrics.jsonl does."""
    tb, ckpt = tmp_path / "tb", tmp_path / "ckpt"
    flags = ("--logger.tensorboard_dir", tb, "--logger.wandb.run_name", "resumed", "--ckpt.path", ckpt,
             "--ckpt.save_steps", 4, "--ckpt.max_num", 5)
    run_sft(*flags, name="run")
    shutil.rmtree(ckpt / "global_step8")
    run = run_sft(*flags, "--ckpt.load_enable", name="run")
    assert sorted(assert_tensorboard_matches_metrics(tb / "resumed", run)["train/loss"]) == list(range(1, 9))


def test_ppo_run_logs_its_metrics_to_tensorboard(sft_nano, tmp_path):
    from posttrain.cli import train_ppo_ray
    from posttrain.rewards.examples import ARITHMETIC

    sft, data = sft_nano
    out, tb = tmp_path / "ppo", tmp_path / "tb"
    train_ppo_ray.main([
        "--actor.model_name_or_path", str(sft), "--data.prompt_dataset", str(data),
        "--data.input_key", "prompt", "--data.label_key", "answer", "--data.apply_chat_template",
        "--data.max_len", "48", "--data.max_samples", "16", "--reward.remote_url", ARITHMETIC,
        "--algo.advantage.estimator", "group_norm", "--algo.kl.init_coef", "0", "--rollout.batch_size", "8",
        "--rollout.n_samples_per_prompt", "4", "--rollout.max_new_tokens", "4", "--train.batch_size", "32",
        "--train.micro_batch_size", "16", "--actor.adam.lr", "1e-3", "--eval.dataset", str(data),
        "--eval.split", "test", "--eval.steps", "1", "--ckpt.output_dir", str(out),
        "--logger.tensorboard_dir", str(tb), "--logger.wandb.run_name", "grpo"])
    assert [p.name for p in tb.iterdir()] == ["grpo"]
    logged = assert_tensorboard_matches_metrics(tb / "grpo", out)
    for key in ("reward/mean", "actor/policy_loss", "actor/grad_norm", "timing/step_total"):
        assert sorted(logged[key]) == [1, 2], key
    assert any(key.startswith("eval") for key in logged), sorted(logged)
