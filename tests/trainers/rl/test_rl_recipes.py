"""OpenRLHF recipes run through `posttrain ppo` (a local nano model and data instead of the hub
ones, sizes scaled down, everything else as the script has it), and the faults a user can cause
end in one clear line and exit code 2 (subprocess tests)."""
import os
import subprocess
import sys

import pytest
from rl_helpers import rewards_by_step

from posttrain.utils.metrics import read_metrics

pytestmark = pytest.mark.e2e

# examples/scripts/train_dapo_ray_hybrid_engine.sh of OpenRLHF 0.10.2 plus the DAPO overlong
# buffer of its README; paths, model, data and sizes are ours, ranks scaled from 8 to 2 (Ray, CPU ranks). Its
# engines are real vLLM engines where vLLM runs (the hybrid engine: colocated, asleep between rollouts), 2 of
# tensor-parallel size 1 for its 1 of size 2 (a TP-2 engine runs here too,
# tests/trainers/rl/test_rl_vllm_tp.py, but its two worker processes take minutes to start on two cores).
# Two steps (16 prompts): the checkpoint of step 2 is the one --ckpt.save_steps 2 writes.
DAPO = """
   --ref.num_nodes 1 --ref.num_gpus_per_node 2 --actor.num_nodes 1 --actor.num_gpus_per_node 2
   --vllm.num_engines 2 --vllm.tensor_parallel_size 1 --train.colocate_all --vllm.gpu_memory_utilization 0.6
   --algo.kl.init_coef 1e-3 --algo.advantage.gamma 1.0 --algo.kl.use_loss --algo.kl.estimator k3
   --algo.advantage.estimator group_norm --algo.dynamic_filtering_enable --algo.dynamic_filtering_range 0 1
   --actor.eps_clip_low_high 0.2 0.27 --ckpt.save_steps 2 --ckpt.save_hf
   --train.micro_batch_size 8 --train.batch_size 32 --rollout.micro_batch_size 16 --rollout.batch_size 8
   --rollout.n_samples_per_prompt 4 --train.max_epochs 1 --data.max_len 24 --data.max_samples 16
   --ds.zero_stage 3 --actor.adam.lr 2e-3 --data.input_key prompt --data.apply_chat_template
   --actor.gradient_checkpointing_enable --ds.packing_samples --vllm.sync_backend nccl --vllm.enforce_eager
   --vllm.enable_sleep --ds.enable_sleep --algo.advantage.is_correction_enable
   --reward.overlong_buffer_len 4 --reward.overlong_penalty_factor 1.0
""".split()


def test_dapo_recipe_runs_on_ray_with_vllm_engines(rl_setup, tmp_path, ray_session, capfd):
    """DAPO: dynamic filtering, clip-higher, k3 KL loss, token-level IS correction, packing, the
    overlong buffer (a float flag; it used to crash at step 1) with per-sample budgets
    (--rollout.max_new_tokens unset), HF exports in checkpoints; vLLM engines where vLLM runs."""
    from posttrain.cli import train_ppo_ray
    from posttrain.config.backends import vllm_unavailable

    sft, data, rewards = rl_setup
    out = tmp_path / "dapo"
    train_ppo_ray.main([*DAPO, "--actor.model_name_or_path", str(sft), "--data.prompt_dataset", str(data),
                        "--data.label_key", "answer",
                        "--reward.remote_url", str(rewards / "starts_with_1.py"),
                        "--ckpt.output_dir", str(out), "--ckpt.path", str(tmp_path / "ck"),
                        "--train.num_episodes", "1", "--ds.param_dtype", "fp32"])
    if vllm_unavailable() is None:
        err = capfd.readouterr().err
        assert "2 rollout engine(s): vllm" in err and "--vllm.enable_sleep: " in err  # the engines sleep
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 2 and all("filter/pass_rate" in r and "actor/kl_loss" in r for r in rows)
    assert all(r["train/rows_per_step"] <= 32 for r in rows)
    assert (tmp_path / "ck" / "global_step2_hf" / "model.safetensors").exists()
    assert len(rewards_by_step(out)) == 2


def run_cli(*args, env=None, timeout=240):
    return subprocess.run([sys.executable, "-m", "posttrain.cli.main", *map(str, args)], check=False,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def ppo_args(rl_setup, out, reward):
    sft, data, rewards = rl_setup
    return ["ppo", "--actor.model_name_or_path", sft, "--data.prompt_dataset", data,
            "--data.input_key", "prompt", "--data.label_key", "answer", "--data.apply_chat_template",
            "--data.max_len", "48", "--reward.remote_url", rewards / reward, "--rollout.batch_size", "4",
            "--rollout.n_samples_per_prompt", "2", "--rollout.max_new_tokens", "4", "--train.batch_size", "8",
            "--train.micro_batch_size", "4", "--data.max_samples", "16", "--algo.kl.init_coef", "0",
            "--ckpt.output_dir", out]


def one_error_line(proc) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback (most recent call last)" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "posttrain ppo: error:" in line]
    assert len(lines) == 1, proc.stderr[-2000:]
    return lines[0]


def test_hanging_reward_function_times_out(rl_setup, tmp_path):
    (tmp_path / "hang.py").write_text("import time\n\ndef reward_func(queries, prompts, labels):\n"
                                      "    while True:\n        time.sleep(0.05)\n")
    sft, data, _ = rl_setup
    proc = run_cli(*ppo_args((sft, data, tmp_path), tmp_path / "out", "hang.py"), "--reward.timeout", "2",
                   "--reward.retries", "1")
    line = one_error_line(proc)
    assert "hang.py" in line and "--reward.timeout" in line


def test_several_processes_are_refused_with_one_line(rl_setup, tmp_path):
    proc = run_cli(*ppo_args(rl_setup, tmp_path / "out", "starts_with_1.py"), env={"WORLD_SIZE": "2"})
    assert "WORLD_SIZE=2" in one_error_line(proc)
