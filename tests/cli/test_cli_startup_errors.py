"""Start-up mistakes end in one line and exit status 2, and flags without effect are named (issue 46,
round 3): broken tokenizer / weights / image-processor files, LoRA targets and ranks the model cannot take,
sizes of 0, and inert flags. In this process through the console command's entry (`in_process`: its exit
status, stdout and stderr, the file descriptors' included): nothing here is about the process itself."""
import json
import shutil
from pathlib import Path

import pytest

from posttrain.utils.metrics import read_metrics
from tests.cli.test_cli_input_errors import flags, in_process, one_error_line, ppo_argv


def rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "response": str(i + 1)}) + "\n"
                            for i in range(8)))
    return path


def sft_run(capfd, model, tmp_path, *extra):
    return in_process(capfd, "sft", *flags(model, rows(tmp_path), tmp_path / "o", "--data.max_samples", "4",
                                           *extra))


def copy(src, dst, edit):
    shutil.copytree(src, dst)
    edit(Path(dst))
    return dst


def no_tokenizer_json(d):
    (d / "tokenizer.json").unlink()


def garbled_tokenizer_json(d):
    (d / "tokenizer.json").write_text("garbage{")


def wider_mlp_in_config(d):
    config = json.loads((d / "config.json").read_text())
    config["intermediate_size"] *= 2
    (d / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("edit, needles", [
    (no_tokenizer_json, ["has no tokenizer.json", "copy the tokenizer files"]),
    (garbled_tokenizer_json, ["tokenizer.json that cannot be read", "copy the tokenizer files"]),
    (wider_mlp_in_config, ["do not have the shapes its config.json gives", "save or download the model"]),
])
def test_a_broken_model_folder_ends_sft_in_one_line(tiny_model_dir, tmp_path, capfd, edit, needles):
    model = copy(tiny_model_dir, tmp_path / "model", edit)
    one_error_line(sft_run(capfd, model, tmp_path), str(model), *needles)


def zero_reward(tmp_path):
    reward = tmp_path / "zero.py"
    reward.write_text("def reward_func(queries, prompts, labels, **kw):\n    return [0.0] * len(queries)\n")
    return reward


def test_a_missing_tokenizer_json_ends_ppo_in_one_line(tiny_model_dir, tmp_path, capfd):
    model = copy(tiny_model_dir, tmp_path / "model", no_tokenizer_json)
    proc = in_process(capfd, *ppo_argv(model, tmp_path, "--reward.remote_url", zero_reward(tmp_path)))
    one_error_line(proc, str(model), "has no tokenizer.json")


@pytest.mark.parametrize("content, needles", [
    (None, ["has no preprocessor_config.json"]),
    ("{bad", ["preprocessor_config.json cannot be read", "not a valid JSON"]),
])
def test_a_vision_model_without_a_readable_image_processor_ends_in_one_line(tiny_vision_dir, tmp_path, capfd,
                                                                           content, needles):
    def edit(d):
        if content is None:
            (d / "preprocessor_config.json").unlink()
        else:
            (d / "preprocessor_config.json").write_text(content)

    model = copy(tiny_vision_dir, tmp_path / "vlm", edit)
    one_error_line(sft_run(capfd, model, tmp_path), *needles, "copy preprocessor_config.json")


@pytest.mark.parametrize("model, extra, needles", [
    ("dense", ["--ds.lora.target_modules", "nonexistent_proj"],
     ["--ds.lora.target_modules nonexistent_proj", "q_proj"]),
    ("moe", ["--ds.lora.target_modules", "experts"],
     ["--ds.lora.target_modules experts", "weights outside linear layers"]),
    ("dense", ["--ds.lora.rank", "100000"],
     ["--ds.lora.rank 100000 exceeds every layer it adapts", "use --ds.lora.rank 128 or less"]),
])
def test_lora_the_model_cannot_take_ends_in_one_line_before_the_adapters_are_built(
        tiny_model_dir, tiny_moe_dir, tmp_path, capfd, model, extra, needles):
    path = tiny_moe_dir if model == "moe" else tiny_model_dir
    proc = sft_run(capfd, path, tmp_path, "--ds.lora.rank", "4", *extra)
    one_error_line(proc, *needles)
    assert "trainable params" not in proc.stdout + proc.stderr  # peft never built the adapters


@pytest.mark.parametrize("command", ["sft", "ppo"])
@pytest.mark.parametrize("flag", ["--ds.tensor_parallel_size", "--ds.ring_attn_size"])
def test_a_group_size_of_0_is_a_range_error(tmp_path, capfd, command, flag):
    if command == "sft":
        proc = in_process(capfd, "sft", *flags("no-such-model-dir", rows(tmp_path), tmp_path / "o", flag,
                                               "0"))
    else:
        proc = in_process(capfd, *ppo_argv("no-such-model-dir", tmp_path, "--reward.remote_url",
                                           zero_reward(tmp_path), flag, "0"))
    one_error_line(proc, f"{flag} 0: must be >= 1")


def notes(proc):
    assert proc.returncode == 0, proc.stderr[-3000:]
    return "\n".join(ln for ln in proc.stderr.splitlines() if "note:" in ln)


@pytest.mark.slow  # a run of a few seconds
def test_sft_names_flags_without_effect_and_what_lora_all_linear_leaves_out_of_a_moe(tiny_moe_dir, tmp_path,
                                                                                     capfd):
    text = notes(sft_run(capfd, tiny_moe_dir, tmp_path, "--ds.lora.rank", "4", "--muon.lr", "0.1",
                         "--muon.momentum", "0.9", "--model.gradient_checkpointing_reentrant",
                         "--data.image_key", "pics"))
    assert ("--model.gradient_checkpointing_reentrant has no effect here: needs "
            "--model.gradient_checkpointing_enable") in text
    assert "--muon.lr 0.1 has no effect here: the Muon group exists only under --optim muon (here adam)" \
        in text
    assert "--muon.momentum 0.9 has no effect here" in text
    assert "--data.image_key pics has no effect here: the run is text only" in text
    assert "all-linear adapts the linear layers (k_proj o_proj q_proj v_proj); experts gate hold weights" \
        in text


@pytest.mark.slow  # a run of a few seconds
def test_ppo_names_flags_without_effect(tiny_model_dir, tmp_path, capfd):
    proc = in_process(capfd, *ppo_argv(
        tiny_model_dir, tmp_path, "--reward.remote_url", zero_reward(tmp_path), "--train.max_steps", "1",
        "--algo.advantage.estimator", "group_norm", "--algo.advantage.lambd", "0.9",
        "--critic.freezing_steps", "3", "--actor.gradient_checkpointing_reentrant", "--actor.muon.lr", "0.1",
        "--data.image_key", "pics"))
    text = notes(proc)
    assert ("--actor.gradient_checkpointing_reentrant has no effect here: needs "
            "--actor.gradient_checkpointing_enable") in text
    assert "--actor.muon.lr 0.1 has no effect here: the Muon group exists only under --actor.optim muon" \
        in text
    assert "--critic.freezing_steps 3 has no effect here: no critic" in text
    assert "--algo.advantage.lambd 0.9 has no effect here: only --algo.advantage.estimator gae reads it" \
        in text
    assert "--data.image_key pics has no effect here" in text
    # without a critic to warm up the actor trains from the first step
    assert "actor/policy_loss" in read_metrics(tmp_path / "out" / "metrics.jsonl")[0]
