"""Rules that the trainers checked while setting up (issue 49) are now decided at start-up: the rules about
flags alone by `parse_config`, before any process or Ray group starts; the rules between flags and a model's
config.json with the other input problems (`trainers.inputs.check_inputs`), before anything loads."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from posttrain.config import parse_config
from posttrain.config.backends import vllm_missing
from posttrain.trainers.inputs import input_problems

TP4 = ("--ds.tensor_parallel_size 4: the model's num_key_value_heads (2) is not divisible by 4; each rank "
       "keeps whole heads and an equal share of the MLP")


def prompts(tmp_path) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"What is {i} + 1?"}) + "\n" for i in range(4)))
    return str(path)


def reward(tmp_path) -> str:
    path = tmp_path / "r.py"
    path.write_text("import torch\n\ndef reward_func(queries, prompts, labels, **kw):\n"
                    "    return torch.zeros(len(queries))\n")
    return str(path)


def ppo_flags(model, tmp_path, *extra):
    return ["--actor.model_name_or_path", model, "--data.prompt_dataset", prompts(tmp_path),
            "--data.input_key", "prompt", "--reward.remote_url", reward(tmp_path),
            "--rollout.batch_size", "2", "--train.batch_size", "2", "--rollout.n_samples_per_prompt", "1",
            "--algo.advantage.estimator", "reinforce", "--ckpt.output_dir", str(tmp_path / "out"), *extra]


def test_heads_against_the_tensor_parallel_size_are_an_input_problem(tiny_model_dir, tmp_path):
    """Reported with the other input problems (here a missing dataset), before any tokenizer or model
    loads."""
    def sft(size):
        return parse_config("sft", ["--model.model_name_or_path", tiny_model_dir, "--data.dataset",
                                    str(tmp_path / "missing.jsonl"), "--ds.tensor_parallel_size", size],
                            check=False)

    found = input_problems(sft("4"))
    assert TP4 in found and any(p.startswith("--data.dataset") for p in found), found
    ppo = parse_config("ppo", ppo_flags(tiny_model_dir, tmp_path, "--ds.tensor_parallel_size", "4",
                                        "--algo.advantage.estimator", "gae"), check=False)
    assert input_problems(ppo) == [TP4]  # the actor, and the critic starting from the same weights: one line
    assert not any("tensor_parallel" in p for p in input_problems(sft("2")))  # 2 divides its heads


def test_a_vision_language_actor_with_async_rl_is_an_input_problem(tiny_vision_dir, tmp_path):
    cfg = parse_config("ppo", ppo_flags(tiny_vision_dir, tmp_path, "--train.async_enable"), check=False)
    assert input_problems(cfg) == [f"{tiny_vision_dir} is a vision-language model: --train.async_enable is "
                                   "not available with one in this version"]
    assert input_problems(parse_config("ppo", ppo_flags(tiny_vision_dir, tmp_path), check=False)) == []


def test_image_flags_against_the_model_are_input_problems(tiny_model_dir, tiny_vision_dir, tmp_path):
    def sft(model, *extra):
        return parse_config("sft", ["--model.model_name_or_path", model, "--data.dataset",
                                    str(tmp_path / "missing.jsonl"), *extra], check=False)

    found = input_problems(sft(tiny_model_dir, "--data.max_images_per_prompt", "1"))
    assert (f"--data.max_images_per_prompt 1: {tiny_model_dir} is not a vision-language model (its config "
            "has no vision part); drop the flag or train a vision-language model") in found, found
    assert any(p.startswith("--data.dataset") for p in found)  # named together with the other problems
    assert (f"--ds.packing_samples: {tiny_vision_dir} is a vision-language model, which trains on padded "
            "batches (it computes its rotary positions per row from the image grid); drop the flag"
            ) in input_problems(sft(tiny_vision_dir, "--ds.packing_samples"))
    assert len(input_problems(sft(tiny_vision_dir, "--data.max_images_per_prompt", "1"))) == 1  # the dataset


@pytest.mark.skipif(vllm_missing() is not None, reason="the rule applies where vLLM engines run")
def test_vllm_tensor_parallel_on_a_gpu_machine_stops_before_ray_starts(tiny_model_dir, tmp_path, monkeypatch,
                                                                       capsys):
    """Before, the refusal came from the engine's Ray worker, after Ray had started and placed the groups."""
    import ray

    from posttrain.cli import train_ppo_ray
    from posttrain.trainers.rl.placement import ray_placement

    started = []

    def start(*args, **kwargs):
        started.append(args)
        raise RuntimeError("Ray started")

    monkeypatch.setattr(ray, "init", start)
    monkeypatch.setattr(ray_placement.RayPlacement, "__init__", start)
    # a CUDA machine, where vLLM's CUDA build runs
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    validate = importlib.import_module("posttrain.config.validate")
    monkeypatch.setattr(validate, "device_type", lambda device=None: "cuda")
    with pytest.raises(SystemExit) as exit_:
        train_ppo_ray.main(ppo_flags(tiny_model_dir, tmp_path, "--vllm.num_engines", "1",
                                     "--vllm.tensor_parallel_size", "2"))
    assert exit_.value.code == 2 and started == []
    lines = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert lines == ["posttrain ppo: error: --vllm.tensor_parallel_size 2: a vLLM engine with tensor "
                     "parallelism runs on CPUs (vLLM's CPU build) in this version, not on GPUs (its Ray "
                     "process is given one GPU); use --vllm.tensor_parallel_size 1 and more "
                     "--vllm.num_engines"]
    assert not (tmp_path / "out").exists()  # nothing started: no run folder either


def test_missing_reward_function_files_are_input_problems(tiny_model_dir, tmp_path):
    """Each --reward.func_path entry's file (`FILE.py` or `FILE.py:NAME`) is checked with the other inputs."""
    here = reward(tmp_path)
    flags = ppo_flags(tiny_model_dir, tmp_path, "--reward.func_path", here, str(tmp_path / "gone.py"),
                      f"{tmp_path / 'away.py'}:short")
    cfg = parse_config("ppo", flags, check=False)
    assert input_problems(cfg) == [f"--reward.func_path: no such file {tmp_path / 'gone.py'}",
                                   f"--reward.func_path: no such file {tmp_path / 'away.py'}"]
