"""Bad input caught with one line and exit status 2 (issue 29, round 2): SFT's dropped rows, broken
model folders, YAML duplicates, values starting with '-'. The real entry points run as subprocesses where the
process matters (a reward file that exits, an agent file); the rest through the same entry in this process
(`in_process`)."""
import json
import os
import subprocess
import sys

import pytest

# transformers' log handler writes to the sys.stderr of transformers' first import: imported here, at
# collection, that is pytest's session-long capture, not the capsys/capfd stream of the first test that loads
# a model in process (closed after it: a later warning would print a logging traceback into `in_process`'s
# stderr)
import transformers.utils.logging  # noqa: F401

from posttrain.utils.metrics import read_metrics

ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}


def run(*args, timeout=300):
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=ENV,
                          timeout=timeout, check=False)


def in_process(capsys, *argv) -> subprocess.CompletedProcess:
    """`posttrain *argv` called in this process through the console command's entry
    (`posttrain.cli.main.main`, which turns a user's mistake into one line on stderr and SystemExit(2)), as
    the CompletedProcess a subprocess run would give (exit status, stdout, stderr: what the call wrote, read
    through `capsys` or `capfd`; what the test wrote before is dropped)."""
    from posttrain.cli.main import main

    capsys.readouterr()
    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as ended:
        code = 0 if ended.code is None else ended.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out, err)


def one_error_line(proc, *needles):
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback (most recent call last)" not in proc.stderr, proc.stderr[-3000:]  # posttrain's own
    line = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert line, proc.stderr[-3000:]
    for needle in needles:
        assert needle in line[-1], line[-1]
    return line[-1]


def flags(model, data, out, *extra):
    return ["--model.model_name_or_path", model, "--data.dataset", data, "--data.input_key", "prompt",
            "--data.output_key", "response", "--train.batch_size", "4", "--train.micro_batch_size", "2",
            "--train.max_epochs", "1", "--ckpt.output_dir", out, "--data.max_len", "48", "--ckpt.save_steps",
            "-1", "--eval.steps", "-1", "--logger.logging_steps", "1", *extra]


def half_long_rows(path):
    """16 rows; the odd ones have a prompt far longer than 48 tokens."""
    rows = [{"prompt": ("word " * 200 if i % 2 else f"What is {i} + 1?"), "response": str(i + 1)}
            for i in range(16)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sft_stops_when_more_than_max_dropped_frac_of_rows_do_not_fit(tiny_model_dir, tmp_path, capsys):
    data = half_long_rows(tmp_path / "rows.jsonl")
    proc = in_process(capsys, "sft", *flags(tiny_model_dir, data, tmp_path / "o"))
    one_error_line(proc, "8 of 16 rows (50%)", "rows.jsonl, row 2", "--data.max_dropped_frac 0.1")
    assert not (tmp_path / "o" / "model.safetensors").exists()


@pytest.mark.slow  # a run of a few seconds
def test_sft_reports_the_rows_it_drops(tiny_model_dir, tmp_path, capfd):
    data = half_long_rows(tmp_path / "rows.jsonl")
    proc = in_process(capfd, "sft", *flags(tiny_model_dir, data, tmp_path / "o", "--data.max_dropped_frac",
                                           "0.5"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "8 of 16 rows (50%) dropped because the prompt alone fills --data.max_len 48" in proc.stderr
    assert "(first: " in proc.stderr and "rows.jsonl, row 2)" in proc.stderr
    assert len(read_metrics(tmp_path / "o" / "metrics.jsonl")) == 2


def broken_copy(src, dst, case):
    import shutil

    shutil.copytree(src, dst)
    if case == "config_not_json":
        (dst / "config.json").write_text('{"model_type": "llama",\n  "hidden_size": 64,,\n}')
    elif case == "corrupt_safetensors":
        (dst / "model.safetensors").write_bytes(b"\xff" * 64)  # the header length reads as ~1.8e19 bytes
    elif case == "auto_map":
        config = json.loads((dst / "config.json").read_text())
        config["auto_map"] = {"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"}
        (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("case, needles", [
    ("config_not_json", ["config.json is not valid JSON", "line 2"]),
    ("corrupt_safetensors", ["model.safetensors cannot be read", "header too large"]),
    ("auto_map", ["config.json has `auto_map`", "trust_remote_code", "does not run"]),
])
def test_a_broken_model_folder_and_a_missing_dataset_are_named_together(tiny_model_dir, tmp_path, case,
                                                                         needles, capsys):
    from pathlib import Path

    model = broken_copy(Path(tiny_model_dir), tmp_path / "model", case)
    # the dataset does not exist either: one error names both (issue 48: every problem, not only the first)
    proc = in_process(capsys, "sft", *flags(model, tmp_path / "missing.jsonl", tmp_path / "o"))
    problems = both_named(proc)
    assert str(model) in problems[0] and all(n in problems[0] for n in needles), problems
    assert problems[1].startswith("--data.dataset: dataset") and "missing.jsonl" in problems[1], problems


def both_named(proc) -> list[str]:
    """The two problem lines of a 'missing or broken inputs' error (model first, then the data)."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    start = next(i for i, ln in enumerate(lines) if "error: missing or broken inputs (2 problems):" in ln)
    return [ln.removeprefix("  - ") for ln in lines[start + 1:start + 3]]


def test_a_model_path_that_is_a_file_is_named_a_file(tiny_model_dir, tmp_path, capsys):
    from pathlib import Path

    weights = Path(tiny_model_dir) / "model.safetensors"
    proc = in_process(capsys, "sft", *flags(weights, tmp_path / "missing.jsonl", tmp_path / "o"))
    assert "is a file, not a folder" in both_named(proc)[0]


def ppo_argv(model, tmp_path, *extra) -> list:
    """`posttrain ppo` of `model` on 8 arithmetic prompts written into `tmp_path`, output in `tmp_path`/out:
    its arguments (from "ppo" on)."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(8)))
    return ["ppo", "--actor.model_name_or_path", model, "--data.prompt_dataset", data, "--data.input_key",
            "prompt", "--data.label_key", "answer", "--data.max_len", "32", "--rollout.batch_size", "2",
            "--rollout.n_samples_per_prompt", "2", "--rollout.max_new_tokens", "2", "--train.batch_size", "4",
            "--train.micro_batch_size", "2", "--data.max_samples", "4", "--algo.kl.init_coef", "0",
            "--ckpt.output_dir", tmp_path / "out", "--ds.param_dtype", "fp32", *extra]


def ppo(model, tmp_path, *extra):
    """`ppo_argv`'s run as a subprocess of the console command's module."""
    return run("-m", "posttrain.cli.main", *ppo_argv(model, tmp_path, *extra))


@pytest.mark.e2e
def test_sys_exit_in_reward_func_ends_ppo_with_an_error_naming_the_file(tiny_model_dir, tmp_path):
    reward = tmp_path / "exits.py"
    reward.write_text("import sys\n\ndef reward_func(queries, prompts, labels, **kw):\n    sys.exit(0)\n")
    proc = ppo(tiny_model_dir, tmp_path, "--reward.remote_url", reward)
    one_error_line(proc, "exits.py", "called sys.exit(0) at", "exits.py:4")
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.e2e
def test_os_exit_while_a_reward_file_loads_ends_ppo_with_an_error_naming_the_file(tiny_model_dir, tmp_path):
    """`os._exit(0)` ends a process at once with status 0: while the file loads it is an error of the file."""
    reward = tmp_path / "hard_exit.py"
    reward.write_text("import os\n\nos._exit(0)\n\n\ndef reward_func(queries, prompts, labels, **kw):\n"
                      "    return [0.0] * len(queries)\n")
    proc = ppo(tiny_model_dir, tmp_path, "--reward.remote_url", reward)
    one_error_line(proc, "hard_exit.py", "called os._exit(0) at", "hard_exit.py:3")
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.e2e
def test_an_agent_instance_that_cannot_be_created_stops_ppo_before_the_models_load(tiny_model_dir, tmp_path):
    agent = tmp_path / "agent.py"
    agent.write_text("from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor\n\n\n"
                     "class AgentInstance(AgentInstanceBase):\n"
                     "    def __init__(self, *args, **kwargs):\n        pass\n\n\n"
                     "class AgentExecutor(MultiTurnAgentExecutor):\n    def __init__(self):\n"
                     "        super().__init__(AgentInstance)\n")
    proc = ppo(tiny_model_dir, tmp_path, "--train.agent_func_path", agent)
    one_error_line(proc, "agent.py", "AgentInstance() with no arguments", "does not implement step")
    assert not (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.slow  # a run of a few seconds
def test_sft_cuts_a_huge_text_field_before_tokenising_and_reports_it(tiny_model_dir, tmp_path, capfd):
    data = tmp_path / "rows.jsonl"
    rows = [{"prompt": f"What is {i} + 1?", "response": str(i + 1)} for i in range(8)]
    rows[3]["response"] = "many words " * 500_000  # 5.5 MB on one line
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = in_process(capfd, "sft", *flags(tiny_model_dir, data, tmp_path / "o"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "SFT train set: 1 rows have a text field longer than" in proc.stderr
    assert "cut to that before tokenising" in proc.stderr
