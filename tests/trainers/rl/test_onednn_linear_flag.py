"""--ds.onednn_linear (default on) / --ds.no_onednn_linear reach every model an RL run loads: the actor,
critic, reference and the rollout engine's own copy (models/cpu_linear.py)."""
import pytest
import torch

from posttrain.config import parse_config
from posttrain.models import load_tokenizer
from posttrain.models.cpu_linear import OneDNNLinear, onednn_available
from posttrain.trainers.rl.build import build_actor, build_critic, build_reference, build_rollout_copy


@pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")
@pytest.mark.parametrize("flags,onednn", [((), True), (("--ds.no_onednn_linear",), False)])
def test_the_flag_reaches_every_role(tiny_model_dir, tmp_path, flags, onednn):
    cfg = parse_config("ppo", ["--actor.model_name_or_path", tiny_model_dir, "--reward.remote_url", "r.py",
                               "--data.prompt_dataset", "p.jsonl", "--algo.kl.init_coef", "0.01",
                               "--ds.param_dtype", "fp32", "--ckpt.output_dir", str(tmp_path), *flags],
                       device="cpu")
    assert cfg.ds.onednn_linear is onednn
    tok, cpu = load_tokenizer(tiny_model_dir), torch.device("cpu")
    models = [build_actor(cfg, tok, cpu, 1).model, build_critic(cfg, tok, cpu, 1).model,
              build_reference(cfg, tok, cpu).model, build_rollout_copy(cfg, tok, cpu).model]
    for model in models:
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all((type(m) is OneDNNLinear) is onednn for m in linears)
