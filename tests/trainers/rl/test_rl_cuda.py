"""`posttrain ppo` on a CUDA GPU in one process (skipped without one): the GPU defaults (bf16 parameters),
LoRA with the adapter-off reference, a separately loaded reference offloaded to CPU memory between
forwards, and gradient checkpointing, each for two GRPO steps whose metrics are finite; a vision-language
actor's images through generation and training."""
import math

import pytest
import torch

from posttrain.utils.metrics import read_metrics

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GRPO = ["--algo.advantage.estimator", "group_norm", "--train.max_steps", "2", "--algo.kl.init_coef", "0.05",
        "--algo.kl.use_loss", "--algo.kl.estimator", "k3"]
LORA = ["--ds.lora.rank", "8", "--ds.lora.alpha", "16", "--actor.adam.lr", "5e-3"]


def _finite_steps(out, keys=("actor/policy_loss", "actor/kl_loss")) -> list[dict]:
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 2
    for row in rows:
        for key in keys:
            assert math.isfinite(row[key]), (key, row)
    return rows


@pytest.mark.parametrize("name,extra", [
    ("lora", LORA),
    ("offload", ["--ref.offload", "--ref.model_name_or_path"]),  # the reference path is appended below
    ("checkpointing", ["--actor.gradient_checkpointing_enable"]),
])
def test_grpo_steps_on_the_gpu(run_ppo, rl_setup, capsys, name, extra):
    if extra[-1] == "--ref.model_name_or_path":
        extra = [*extra, str(rl_setup[0])]
    out, _ = run_ppo(*GRPO, *extra, name=name)
    _finite_steps(out)
    err = capsys.readouterr().err
    assert "cuda" in err, err[-3000:]  # the start-up summary names the device
    if name == "lora":
        assert "the actor's base weights with its LoRA adapter disabled" in err


def test_a_vision_language_actor_on_the_gpu(tiny_vision_dir, tmp_path, capsys):
    """Images through generation and training on the GPU (fp32 for the exact comparison): the trainer's
    log-probs equal the sampling ones, and two GRPO steps in the GPU defaults (bf16) run."""
    from posttrain.cli import train_ppo_ray
    from posttrain.config import parse_config
    from posttrain.data.synthetic_vision import write_colour_dataset
    from posttrain.trainers.rl.ppo import RLTrainer

    data = write_colour_dataset(tmp_path / "colours", 16, seed=0)
    flags = ["--actor.model_name_or_path", tiny_vision_dir, "--data.prompt_dataset", data,
             "--data.input_key", "prompt", "--data.label_key", "answer", "--data.apply_chat_template",
             "--data.max_images_per_prompt", "1",
             "--reward.remote_url", "posttrain/rewards/examples/colour_reward.py",
             "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4",
             "--rollout.batch_size", "4", "--rollout.max_new_tokens", "4", "--train.batch_size", "16",
             "--train.micro_batch_size", "8", "--rollout.micro_batch_size", "8", "--algo.kl.init_coef", "0",
             "--actor.freeze_visual_encoder"]
    trainer = RLTrainer(parse_config("ppo", [*flags, "--ds.param_dtype", "fp32", "--train.max_steps", "1",
                                             "--ckpt.output_dir", str(tmp_path / "exact")]))
    assert trainer.device.type == "cuda"
    scored, _, _ = trainer.produce(0)
    exp, _ = trainer.experience_maker.make(scored, 0.0)
    mask = exp.action_mask.bool()
    with torch.no_grad():
        recomputed = trainer.actor.logprobs(exp, trainer.experience_maker.batching).cpu()
    torch.testing.assert_close(recomputed[mask.cpu()], exp.rollout_logp.cpu()[mask.cpu()], rtol=0, atol=1e-4)
    trainer.start.folders.close()
    train_ppo_ray.main([*flags, "--train.max_steps", "2", "--ckpt.output_dir", str(tmp_path / "bf16")])
    _finite_steps(tmp_path / "bf16", keys=("actor/policy_loss",))
