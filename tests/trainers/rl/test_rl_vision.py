"""RL with a vision-language actor: prompts carry their images from the data through the HF engine's
generation to every later pass (the trainer's log-probs equal the sampling ones, and another image gives
other log-probs), `--actor.freeze_visual_encoder` keeps the vision tower as loaded, OpenRLHF's VLM script
flags on Ray (2 actor ranks, ZeRO-3, an engine of its own) give the one-process run, and what this version
does not run with a VLM is a one-line error."""
import pytest
import torch
from rounding import ADAM_EPS, adam_weight_tolerance, assert_weights_within
from safetensors.torch import load_file

from posttrain.data.synthetic_vision import write_colour_dataset
from posttrain.models.vision import is_vision_folder, load_processor
from posttrain.utils.metrics import read_metrics

pytestmark = pytest.mark.slow
REWARD = "posttrain/rewards/examples/colour_reward.py"


@pytest.fixture(scope="module")
def colours(tmp_path_factory):
    return write_colour_dataset(tmp_path_factory.mktemp("colours"), 16, seed=0)


def _flags(model, data, out, *extra):
    return ["--actor.model_name_or_path", str(model), "--data.prompt_dataset", str(data),
            "--data.input_key", "prompt", "--data.label_key", "answer", "--data.apply_chat_template",
            "--data.max_images_per_prompt", "1", "--reward.remote_url", REWARD,
            "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4",
            "--rollout.batch_size", "4", "--rollout.max_new_tokens", "4", "--rollout.micro_batch_size", "8",
            "--train.batch_size", "16", "--train.micro_batch_size", "8", "--actor.adam.lr", "1e-3",
            "--actor.lr_warmup_ratio", "0", "--algo.kl.init_coef", "0", "--ckpt.output_dir", str(out),
            *map(str, extra)]


def _trainer(*flags):
    from posttrain.config import parse_config
    from posttrain.trainers.rl.ppo import RLTrainer

    return RLTrainer(parse_config("ppo", list(flags), device="cpu"))


def test_the_trainers_log_probs_equal_the_sampling_ones_and_the_image_matters(tiny_vision_dir, colours,
                                                                              tmp_path,
                                                                                one_torch_thread):
    trainer = _trainer(*_flags(tiny_vision_dir, colours, tmp_path / "o", "--train.max_steps", "1"))
    scored, _, _ = trainer.produce(0)
    exp, _ = trainer.experience_maker.make(scored, 0.0)
    assert exp.image_inputs is not None and all(im is not None for im in exp.image_inputs)
    mask = exp.action_mask.bool()
    batching = trainer.experience_maker.batching
    with torch.no_grad():
        recomputed = trainer.actor.logprobs(exp, batching)
        torch.testing.assert_close(recomputed[mask], exp.rollout_logp[mask], rtol=0, atol=1e-5)
        other = [{**im, "pixel_values": im["pixel_values"][::-1].copy()} for im in exp.image_inputs]
        exp.image_inputs = other  # the same tokens with other pixels: other log-probs
        assert (trainer.actor.logprobs(exp, batching)[mask] - recomputed[mask]).abs().max() > 1e-4
    # the reward function reads the response after the prompt text, which is the decoded (expanded) prompt
    r = scored.rollouts[0]
    assert r.prompt_text.count("<|image_pad|>") == 4
    trainer.start.folders.close()


def test_freeze_visual_encoder_trains_the_language_model_only(tiny_vision_dir, colours, tmp_path,
                                                              run_ppo_cli):
    spread = tmp_path / "spread.py"  # a reward with spread inside a group from a random-init policy
    spread.write_text("import torch\n\ndef reward_func(queries, prompts, labels, **kw):\n"
                      "    return torch.tensor([float(len(q) % 2) for q in queries])\n")
    flags = _flags(tiny_vision_dir, colours, tmp_path / "o", "--train.max_steps", "2",
                   "--actor.freeze_visual_encoder")
    flags[flags.index(REWARD)] = str(spread)
    out = run_ppo_cli(flags)
    before, after = (load_file(f"{tiny_vision_dir}/model.safetensors"),
                     load_file(str(out / "model.safetensors")))
    vision = [k for k in before if "visual." in k]  # the checkpoint's own names: visual.* and model.*
    language = [k for k in before if "visual." not in k]
    assert vision and language
    # compared in the export's dtype (bf16 where the run's default is bf16, on a GPU)
    assert all(torch.equal(before[k].to(after[k].dtype), after[k]) for k in vision)
    assert any(not torch.equal(before[k].to(after[k].dtype), after[k]) for k in language)
    assert len(read_metrics(out / "metrics.jsonl")) == 2


@pytest.mark.parametrize("extra,message", [
    (["--train.async_enable"], "--train.async_enable is not available with one"),
    (["--ds.packing_samples"], "--ds.packing_samples: not supported with images"),
])
def test_what_this_version_does_not_run_with_a_vlm_is_one_line(tiny_vision_dir, colours, tmp_path, capsys,
                                                               extra,
                                                                 message):
    import re

    from posttrain.cli import train_ppo_ray

    with pytest.raises(SystemExit) as exc:
        train_ppo_ray.main(_flags(tiny_vision_dir, colours, tmp_path / "o", *extra))
    assert exc.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("posttrain ppo: error")]
    assert len(lines) == 1 and re.search(message, lines[0]), lines


def test_images_with_a_text_actor_are_one_line(tiny_model_dir, colours, tmp_path, capsys):
    from posttrain.cli import train_ppo_ray

    with pytest.raises(SystemExit) as exc:
        train_ppo_ray.main(_flags(tiny_model_dir, colours, tmp_path / "o"))
    assert exc.value.code == 2 and "is not a vision-language model" in capsys.readouterr().err


@pytest.fixture
def run_ppo_cli():
    def run(flags):
        from posttrain.cli import train_ppo_ray

        train_ppo_ray.main(flags)
        return __import__("pathlib").Path(flags[flags.index("--ckpt.output_dir") + 1])
    return run


# examples/scripts/train_vlm_math_hybrid_engine.sh of OpenRLHF 0.10.2, ranks and engines 4 -> 2, the model,
# data, reward, sizes and steps ours, bf16 -> fp32 (CPU); its GPU-only flags are reported as having no effect
VLM_HYBRID = """
   --ref.num_nodes 1 --ref.num_gpus_per_node 2 --actor.num_nodes 1 --actor.num_gpus_per_node 2
   --vllm.num_engines 2 --vllm.tensor_parallel_size 1 --train.colocate_all --vllm.gpu_memory_utilization 0.7
   --algo.kl.init_coef 0 --algo.advantage.gamma 1.0 --algo.kl.use_loss --algo.kl.estimator k2
   --algo.advantage.estimator reinforce_baseline --ckpt.save_hf --eval.steps -1
   --train.micro_batch_size 1 --rollout.micro_batch_size 1 --train.batch_size 16 --rollout.batch_size 4
   --rollout.n_samples_per_prompt 4 --train.num_episodes 1 --data.max_len 64 --rollout.max_new_tokens 4
   --ds.zero_stage 3 --ds.param_dtype fp32 --actor.adam.lr 2e-3 --data.input_key prompt
   --data.label_key answer --data.image_key images --data.max_images_per_prompt 1
   --actor.freeze_visual_encoder --data.apply_chat_template
   --actor.gradient_checkpointing_enable --ds.attn_implementation eager --vllm.sync_backend nccl
   --vllm.enforce_eager --vllm.enable_sleep --ds.enable_sleep --train.max_steps 2 --rollout.engine hf
""".split()  # the HF engine: the test compares the Ray run's samples with the in-process run's


@pytest.mark.e2e
def test_openrlhf_vlm_script_on_ray_equals_one_process(tiny_vision_dir, colours, tmp_path, ray_session):
    from posttrain.cli import train_ppo_ray

    spread = tmp_path / "spread.py"
    spread.write_text("import torch\n\ndef reward_func(queries, prompts, labels, **kw):\n"
                      "    return torch.tensor([float(len(q) % 2) for q in queries])\n")
    base = ["--actor.model_name_or_path", tiny_vision_dir, "--data.prompt_dataset", colours,
            "--reward.remote_url", str(spread), *VLM_HYBRID, "--actor.adam.eps", str(ADAM_EPS)]
    one = ["--ref.num_gpus_per_node", "1", "--actor.num_gpus_per_node", "1", "--vllm.num_engines", "0"]
    train_ppo_ray.main([*base, *one, "--ckpt.output_dir", str(tmp_path / "local")])
    train_ppo_ray.main([*base, "--ckpt.output_dir", str(tmp_path / "ray")])
    local, ray_run = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("local", "ray"))
    rewards = [[r["reward/mean"] for r in read_metrics(tmp_path / d / "metrics.jsonl")]
               for d in ("local", "ray")]
    assert rewards[0] == pytest.approx(rewards[1], abs=1e-6) and len(rewards[0]) == 2  # the same samples
    # equal up to rounding (rounding.py): 2 steps of one optimizer step each at the script's lr 2e-3
    norms = [r["actor/grad_norm"] for r in read_metrics(tmp_path / "local" / "metrics.jsonl")
             if "actor/grad_norm" in r]
    assert_weights_within(local, ray_run, adam_weight_tolerance(2e-3, norms))
    before = load_file(f"{tiny_vision_dir}/model.safetensors")
    assert all(torch.equal(before[k], ray_run[k]) for k in before if "visual." in k)
    assert any(not torch.equal(before[k], ray_run[k]) for k in before if "visual." not in k)
    # a frozen vision tower is not sent to the engines (OpenRLHF's rule): the language model's bytes only
    language = sum(t.numel() * t.element_size() for k, t in before.items() if "visual." not in k)
    synced = {r["sync/bytes"] for r in read_metrics(tmp_path / "ray" / "metrics.jsonl") if "sync/bytes" in r}
    assert synced and all(language <= b < language * 1.5 for b in synced), (synced, language)
    assert is_vision_folder(tmp_path / "ray") and load_processor(tmp_path / "ray").image_processor is not None
