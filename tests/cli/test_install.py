"""The install: `posttrain --version`, the core install (no Ray, DeepSpeed, servers, math-verify or
TensorBoard) runs one-process SFT and PPO, and a run that asks for a missing optional part stops with one
line naming its extra. The optional packages are blocked in the subprocess (`sys.modules[name] = None` in a
`sitecustomize`), never uninstalled."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

OPTIONAL = ("ray", "deepspeed", "fastapi", "uvicorn", "math_verify", "tensorboard")
BLOCKER = ("import os, sys\nfor name in filter(None, os.environ['POSTTRAIN_TEST_BLOCK'].split(',')):\n"
           "    sys.modules[name] = None\n")


def cli(tmp_path, *args, block=(), env=None):
    """`python -m posttrain.cli.main *args` with the modules `block` unimportable (as if not installed)."""
    site = tmp_path / "blocker"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "PYTHONPATH": path,
           "POSTTRAIN_TEST_BLOCK": ",".join(block), **(env or {})}
    env.pop("RAY_ADDRESS", None)
    return subprocess.run([sys.executable, "-m", "posttrain.cli.main", *map(str, args)], capture_output=True,
                          text=True, env=env, timeout=600, check=False)


def prompts(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n"
                            for i in range(8)))
    return data


def ppo_flags(model, tmp_path, reward, *extra):
    return ["ppo", "--actor.model_name_or_path", model, "--data.prompt_dataset", prompts(tmp_path),
            "--data.input_key", "prompt", "--data.label_key", "answer", "--data.max_len", "32",
            "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2",
            "--rollout.max_new_tokens", "2",
            "--train.batch_size", "4", "--train.micro_batch_size", "2", "--data.max_samples", "4",
            "--algo.kl.init_coef", "0", "--reward.remote_url", reward, "--ckpt.output_dir", tmp_path / "rl",
            "--ds.param_dtype", "fp32", *extra]


def sft_flags(model, tmp_path, *extra):
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "response": f" {i + 1}"}) + "\n"
                            for i in range(8)))
    return ["sft", "--model.model_name_or_path", model, "--data.dataset", data, "--data.input_key", "prompt",
            "--data.output_key", "response", "--train.batch_size", "4", "--train.micro_batch_size", "2",
            "--ckpt.output_dir", tmp_path / "sft", *extra]


ARITHMETIC = os.path.join(os.path.dirname(__file__), "..", "..", "posttrain", "rewards", "examples",
                          "arithmetic_reward.py")


def test_version_prints_posttrain_torch_and_transformers(tmp_path):
    import posttrain

    for flag in ("--version", "-V"):
        proc = cli(tmp_path, flag)
        assert proc.returncode == 0, proc.stderr
        first, second = proc.stdout.strip().splitlines()
        assert first == f"posttrain {posttrain.__version__}"
        from importlib.metadata import version

        assert second.startswith(f"torch {version('torch')}, transformers {version('transformers')}, Python ")


def test_the_core_install_runs_init_tiny_and_one_process_sft_and_ppo(tmp_path):
    """No Ray, DeepSpeed, FastAPI, uvicorn, math-verify or TensorBoard: init-tiny, then SFT (one step, with a
    checkpoint that ds-to-hf converts) and PPO (one step, HF engine, reward file) run to the end in one
    process and save their models."""
    tiny = cli(tmp_path, "init-tiny", "--output", tmp_path / "tiny", "--size", "nano", block=OPTIONAL)
    assert tiny.returncode == 0, tiny.stderr[-3000:]
    flags = sft_flags(tmp_path / "tiny", tmp_path, "--data.max_samples", "4", "--ckpt.save_steps", "1")
    sft = cli(tmp_path, *flags, block=OPTIONAL)
    assert sft.returncode == 0, sft.stderr[-3000:]
    assert (tmp_path / "sft" / "model.safetensors").exists()
    hf = cli(tmp_path, "ds-to-hf", "--checkpoint", tmp_path / "sft" / "checkpoints" / "global_step1",
             "--model_path", tmp_path / "tiny", "--output_path", tmp_path / "hf", "--ds.param_dtype", "fp32",
             block=OPTIONAL)
    assert hf.returncode == 0, hf.stderr[-3000:]
    assert (tmp_path / "hf" / "model.safetensors").exists()
    rl = cli(tmp_path, *ppo_flags(tmp_path / "sft", tmp_path, ARITHMETIC, "--train.max_steps", "1"),
             block=OPTIONAL)
    assert rl.returncode == 0, rl.stderr[-3000:]
    assert (tmp_path / "rl" / "model.safetensors").exists()


def one_line(proc, expected):
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == expected


def test_a_run_on_ray_without_ray_names_the_extra(tiny_model_dir, tmp_path):
    proc = cli(tmp_path, *ppo_flags(tiny_model_dir, tmp_path, ARITHMETIC, "--vllm.num_engines", "1"),
               block=OPTIONAL)
    one_line(proc, "posttrain ppo: error: --vllm.num_engines 1 needs Ray, which is not installed: "
                   "pip install -e '.[ray]'")


def test_a_role_on_several_ranks_without_ray_and_deepspeed_names_both_extras(tiny_model_dir, tmp_path):
    proc = cli(tmp_path, *ppo_flags(tiny_model_dir, tmp_path, ARITHMETIC, "--actor.num_gpus_per_node", "2"),
               block=OPTIONAL)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    ranks = "--actor.num_nodes 1 x --actor.num_gpus_per_node 2"
    assert proc.stderr.strip().splitlines()[-2:] == [
        f"  - {ranks} needs Ray, which is not installed: pip install -e '.[ray]'",
        f"  - {ranks} needs DeepSpeed, which is not installed: pip install -e '.[deepspeed]'"]


@pytest.mark.parametrize(("extra", "block", "expected"), [
    (["--ds.adam_offload"], "deepspeed",
     "--ds.adam_offload needs DeepSpeed, which is not installed: pip install -e '.[deepspeed]'"),
    (["--logger.tensorboard_dir", "TB"], "tensorboard",
     "--logger.tensorboard_dir needs TensorBoard, which is not installed: pip install -e '.[tensorboard]'"),
])
def test_an_sft_flag_that_needs_a_missing_part_names_the_extra(tiny_model_dir, tmp_path, extra, block,
                                                                expected):
    extra = [str(tmp_path / "tb") if e == "TB" else e for e in extra]
    proc = cli(tmp_path, *sft_flags(tiny_model_dir, tmp_path, *extra), block=(block,))
    one_line(proc, f"posttrain sft: error: {expected}")
    assert not (tmp_path / "sft" / "model.safetensors").exists()


def test_sft_on_several_ranks_without_deepspeed_names_the_extra(tiny_model_dir, tmp_path):
    proc = cli(tmp_path, *sft_flags(tiny_model_dir, tmp_path), block=("deepspeed",),
               env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"})
    one_line(proc, "posttrain sft: error: training on 2 ranks (WORLD_SIZE=2) needs DeepSpeed, which is not "
                   "installed: pip install -e '.[deepspeed]'")


def test_a_reward_file_using_the_math_grader_without_math_verify_names_the_extra(tiny_model_dir, tmp_path):
    reward = tmp_path / "math_reward.py"
    reward.write_text("from openrlhf.utils import grade_answer\n\n\n"
                      "def reward_func(queries, prompts, labels):\n"
                      "    return [float(grade_answer(q[len(p):], a))\n"
                      "            for q, p, a in zip(queries, prompts, labels)]\n")
    proc = cli(tmp_path, *ppo_flags(tiny_model_dir, tmp_path, reward, "--train.max_steps", "1"),
               block=("math_verify",))
    one_line(proc, f"posttrain ppo: error: reward function file {reward} (it imports grade_answer) needs "
                   "math-verify, which is not installed: pip install -e '.[math]'")


def test_serve_rm_without_fastapi_names_the_extra(tmp_path):
    proc = cli(tmp_path, "serve-rm", "--reward.remote_url", ARITHMETIC, "--port", "0", block=("fastapi",))
    one_line(proc, "posttrain serve-rm: error: serving over HTTP needs FastAPI, which is not installed: "
                   "pip install -e '.[serve]'")
