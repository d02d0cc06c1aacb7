"""`posttrain ppo` on a CUDA GPU in one process (skipped without one): the GPU defaults (bf16 parameters),
LoRA with the adapter-off reference, a separately loaded reference offloaded to CPU memory between
forwards, and gradient checkpointing, each for two GRPO steps whose metrics are finite."""
import math

import pytest
import torch

from posttrain.utils.metrics import read_metrics

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GRPO = ["--algo.advantage.estimator", "group_norm", "--train.max_steps", "2", "--algo.kl.init_coef", "0.05",
        "--algo.kl.use_loss", "--algo.kl.estimator", "k3"]
LORA = ["--ds.lora.rank", "8", "--ds.lora.alpha", "16", "--actor.adam.lr", "5e-3"]


def _finite_steps(out) -> list[dict]:
    rows = read_metrics(out / "metrics.jsonl")
    assert len(rows) == 2
    for row in rows:
        for key in ("actor/policy_loss", "actor/kl_loss"):
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
