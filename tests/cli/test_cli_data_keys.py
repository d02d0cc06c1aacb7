"""Every data-key problem named at once, before anything is echoed (issue 48, item 4): the key flags a command
reads are checked against the first row of every training and eval data file at start-up, in the one error
that also names the missing paths. In process, through `posttrain.cli.main.main` (nothing loads a model)."""
import json

import pytest

from posttrain.cli.main import main
from posttrain.config import parse_config


def write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sft_rows(path):
    return write(path, [{"prompt": f"What is {i} + 1?", "response": str(i + 1)} for i in range(8)])


def problems_of(capsys, *argv) -> list[str]:
    """The problem lines of the one error `posttrain *argv` ends with: status 2, nothing echoed before it."""
    with pytest.raises(SystemExit) as ended:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert ended.value.code == 2, err
    assert "Traceback" not in err and "flag(s) set" not in err and "config.yaml" not in err, err
    lines = err.splitlines()
    assert any("error: missing or broken inputs" in ln for ln in lines), err  # one error, several problems
    start = next(i for i, ln in enumerate(lines) if "error: missing or broken inputs" in ln)
    assert lines[start].endswith(f"({len(lines) - start - 1} problems):"), err
    return [ln.removeprefix("  - ") for ln in lines[start + 1:]]


def test_sft_names_both_wrong_keys_in_one_error_before_the_echo(tiny_model_dir, tmp_path, capsys):
    data = sft_rows(tmp_path / "sft.jsonl")
    out = tmp_path / "runs" / "sft"
    problems = problems_of(capsys, "sft", "--model.model_name_or_path", tiny_model_dir, "--data.dataset",
                           data, "--data.input_key", "instruction", "--data.output_key", "respons",
                           "--ckpt.output_dir", out)
    assert problems == [
        f"--data.input_key 'instruction': missing from {data} (its keys: [prompt, response]); name one of "
        "them with --data.input_key, or fix the data",
        f"--data.output_key 'respons': missing from {data} (its keys: [prompt, response]); did you mean "
        "'response'?",
    ]
    assert not (tmp_path / "runs").exists()


def test_dpo_names_a_wrong_chosen_key_and_a_missing_eval_dataset(tiny_model_dir, tmp_path, capsys):
    data = write(tmp_path / "prefs.jsonl", [{"prompt": "What is 1 + 1?", "chosen": "2", "rejected": "3"}] * 4)
    missing = tmp_path / "heldout" / "prefs.jsonl"
    problems = problems_of(capsys, "dpo", "--model.model_name_or_path", tiny_model_dir, "--data.dataset",
                           data, "--data.prompt_key", "prompt", "--data.chosen_key", "Chosen",
                           "--eval.dataset", missing, "--ckpt.output_dir", tmp_path / "out")
    assert problems == [
        f"--eval.dataset: dataset '{missing}': no such file or folder ({missing}).",
        f"--data.chosen_key 'Chosen': missing from {data} (its keys: [prompt, chosen, rejected]); did you "
        "mean 'chosen'?",
    ]


def test_ppo_names_a_wrong_input_key_and_label_key_once_each(tiny_model_dir, tmp_path, capsys):
    """The prompt file is also the eval dataset: each key it lacks is named once."""
    data = write(tmp_path / "prompts.jsonl", [{"prompt": f"{i}+1?", "answer": str(i + 1)} for i in range(8)])
    reward = tmp_path / "zero.py"
    reward.write_text("def reward_func(queries, prompts, labels, **kw):\n    return [0.0] * len(queries)\n")
    problems = problems_of(capsys, "ppo", "--actor.model_name_or_path", tiny_model_dir,
                           "--data.prompt_dataset", data, "--data.input_key", "input", "--data.label_key",
                           "answers", "--eval.dataset", data, "--reward.remote_url", reward,
                           "--ckpt.output_dir", tmp_path / "out")
    assert problems == [
        f"--data.input_key 'input': missing from {data} (its keys: [prompt, answer]); name one of them with "
        "--data.input_key, or fix the data",
        f"--data.label_key 'answers': missing from {data} (its keys: [prompt, answer]); did you mean "
        "'answer'?",
    ]


def test_eval_folder_shards_a_split_the_data_lacks_margin_and_image_keys(tmp_path):
    """Shards of a folder with the same keys: one line; a split the eval folder lacks: its loader's error;
    the margin RM reads with --model.margin_loss_enable; an image key set on a run that reads images: named
    when no file has it (a row without images may lack it), unchecked at its default."""
    from posttrain.trainers.inputs import key_problems

    def config(trainer, *argv):
        return parse_config(trainer, ["--model.model_name_or_path", "m", *map(str, argv)])

    for i in range(3):
        write(tmp_path / "prefs" / f"train-0000{i}.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}])
    rm = config("rm", "--data.dataset", tmp_path / "prefs", "--data.prompt_key", "prompt",
                "--model.margin_loss_enable", "--eval.dataset", tmp_path / "prefs", "--eval.split", "test")
    assert key_problems(rm) == [
        f"--model.margin_loss_enable (key 'margin'): missing from {tmp_path / 'prefs' / 'train-00000.jsonl'} "
        "and 2 more files (their keys: [prompt, chosen, rejected]); add it to every row, or drop "
        "--model.margin_loss_enable",
        f"--eval.dataset: {tmp_path / 'prefs'}: no files for split 'test'; found splits ['train'] (a file "
        "belongs to split s when its name starts with s or it sits in a folder named s).",
    ]

    images = write(tmp_path / "images.jsonl", [{"prompt": "Describe <image>", "image": "a.png"}])
    vlm = ("--data.input_key", "prompt", "--data.apply_chat_template", "--data.max_images_per_prompt", "1")
    assert key_problems(config("sft", "--data.dataset", images, *vlm)) == []  # the default key: unchecked
    assert key_problems(config("sft", "--data.dataset", images, *vlm, "--data.image_key", "imgs")) == [
        f"--data.image_key 'imgs': missing from {images} (its keys: [prompt, image]); did you mean 'image'?"]
    text_first = write(tmp_path / "mixed" / "a.jsonl", [{"prompt": "hi"}])
    write(tmp_path / "mixed" / "b.jsonl", [{"prompt": "Describe <image>", "image": "a.png"}])
    mixed = config("sft", "--data.dataset", text_first.parent, *vlm, "--data.image_key", "image")
    assert key_problems(mixed) == []  # one file has it
    nowhere = config("sft", "--data.dataset", text_first.parent, *vlm, "--data.image_key", "img")
    assert key_problems(nowhere) == [
        "--data.image_key 'img': missing from each of the 2 files of --data.dataset (their keys: [prompt, "
        "image]); did you mean 'image'?"]
