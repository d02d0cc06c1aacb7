"""A user's mistake is reported before torch, transformers or any heavy extra is imported (issue 49): for
every command, the path from `posttrain <command> <flags>` to its one `error:` line and exit status 2 runs
under `python -X importtime`, which lists every module the process imported."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

HEAVY = {"torch", "transformers", "deepspeed", "ray", "vllm", "peft"}
# CUDA_VISIBLE_DEVICES="": torch could see no GPU, so the device check needs no torch on a GPU machine either
ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}


def imported_modules(stderr: str) -> set[str]:
    """The top-level packages `-X importtime` lists (lines 'import time: self | cumulative | name')."""
    return {line.rsplit("|", 1)[1].strip().split(".")[0] for line in stderr.splitlines()
            if line.startswith("import time:") and "|" in line}


def cases(tmp, model):
    """(command line, a needle of its error line): one mistake per command and kind of mistake."""
    rows = tmp / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "1 + 1 =", "response": "2", "label": "2"}) + "\n")
    finished = tmp / "finished"
    finished.mkdir()
    (finished / "summary.json").write_text("{}")
    train = ["--model.model_name_or_path", model, "--data.dataset", rows]
    return [
        (["sft", *train, "--trian.batch_size", "4"], "unknown flag --trian.batch_size"),
        (["sft", "--model.model_name_or_path", tmp / "none", "--data.dataset", rows], "not found"),
        (["sft", *train, "--data.input_key", "prompt", "--data.output_key", "response",
          "--ckpt.output_dir", finished], "holds a finished run"),
        (["rm", *train], "--data.chosen_key 'chosen'"),
        # a flag whose rule reads the model's config.json (packing: not with a vision-language
        # model) stays light
        (["sft", *train, "--ds.packing_samples", "--data.input_key", "promt"],
         "did you mean 'prompt'"),
        (["dpo", *train, "--train.batch_size", "0"], "--train.batch_size 0"),
        (["ppo", "--actor.model_name_or_path", model, "--data.prompt_dataset", rows], "a reward source"),
        (["generate", "--model.model_name_or_path", model, "--data.dataset", rows, "--output", tmp],
         "is a folder"),
        (["eval", "--model.model_name_or_path", tmp / "none", "--data.dataset", rows], "not found"),
        (["chat", "--model.model_name_or_path", tmp / "none"], "not found"),
        (["serve-rm", "--reward.model_name_or_path", tmp / "none"], "not found"),
        (["init-tiny", "--output", tmp / "t", "--shape", "nope"], "unknown shape"),
        (["lora-merge", "--lora_path", tmp / "none", "--output_path", tmp / "m"], "no such folder"),
        (["ds-to-hf", "--checkpoint", tmp / "none", "--model_path", model, "--output_path", tmp / "h"],
         "no such folder"),
        (["plot", tmp / "none"], "no metrics.jsonl"),
        (["demo", "--quick", "--seed", "x"], "invalid int value"),
    ]


def test_a_mistake_is_reported_before_torch_or_transformers_load(tiny_model_dir, tmp_path):
    failures = []
    for argv, needle in cases(tmp_path, tiny_model_dir):
        command = [sys.executable, "-X", "importtime", "-m", "posttrain.cli.main", *map(str, argv)]
        proc = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=120, check=False)
        said = "\n".join(ln for ln in proc.stderr.splitlines() if not ln.startswith("import time:"))
        assert proc.returncode == 2 and f"{argv[0]}: error:" in said and needle in said, (argv, said[-2000:])
        assert "Traceback" not in said, said[-2000:]
        heavy = sorted(HEAVY & imported_modules(proc.stderr))
        if heavy:
            failures.append(f"posttrain {argv[0]} ({needle}) imported {', '.join(heavy)}")
    assert not failures, "\n".join(failures)
