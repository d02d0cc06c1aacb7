"""Tensor parallelism (`models/tensor_parallel.py`, DeepSpeed AutoTP): a tiny model split over 2 gloo ranks
gives the unsplit model's logits, gradients, gradient norm and (gathered) weights after a step, with q/k/v
biases (qwen2), grouped key/value heads and an untied head; each rank holds half of the split layers plus the
replicated rest, and optimizer state for what it holds. The checks that refuse a model the split does not
fit."""
import os
import re
import socket
import subprocess
import sys

import pytest
import torch

from posttrain.models import tensor_parallel as tp
from posttrain.models.config_facts import check_tensor_parallel_config
from posttrain.utils.errors import ConfigError

HERE = os.path.dirname(os.path.abspath(__file__))


def test_heads_and_mlp_width_must_divide_by_the_group():
    llama = {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 352}
    check_tensor_parallel_config(llama, 2)
    with pytest.raises(ConfigError, match=r"^--ds.tensor_parallel_size 4: the model's num_key_value_heads "
                                          r"\(2\) is not divisible by 4"):
        check_tensor_parallel_config(llama, 4)
    with pytest.raises(ConfigError, match=r"num_attention_heads \(6\)"):
        check_tensor_parallel_config({"text_config": {"num_attention_heads": 6, "intermediate_size": 8}}, 4)
    with pytest.raises(ConfigError,
                       match=r"^--ds.tensor_parallel_size 2: mixture-of-experts models have no "):
        check_tensor_parallel_config({**llama, "num_experts": 8, "num_experts_per_tok": 2}, 2)


def test_layers_without_a_split_are_refused_by_name():
    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.self_attn = torch.nn.Module()
            self.self_attn.q_proj = torch.nn.Linear(4, 4)
            self.mlp = torch.nn.Module()
            self.mlp.down_proj = torch.nn.Linear(4, 4)

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([Layer()])
    model.lm_head = torch.nn.Linear(4, 8)
    tp.check_modules(model, 2)
    model.layers[0].mlp.experts = torch.nn.ModuleList([torch.nn.Linear(4, 4)])  # an MoE expert
    with pytest.raises(ConfigError, match=r"^--ds.tensor_parallel_size 2: module layers.0.mlp.experts.0 "
                                          r"\(Linear\) has no tensor-parallel split in this version"):
        tp.check_modules(model, 2)
    assert tp.autotp_config(2) == {"autotp_size": 2, "vocab_parallel_lm_head": False}  # whole logits


CASES = [("llama", "0"), ("qwen2", "0"), ("llama", "1")]  # (arch, untied head): the cases of `all_cases`


@pytest.fixture(scope="module")
def all_cases(tmp_path_factory):
    """One torchrun launch of tensor_parallel_worker.py over every case of CASES (a launch costs seconds of
    start-up, a case a fraction of one): the finished process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "TP_CASES": ";".join(f"{arch}:{untied}" for arch, untied in CASES),
           "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    models = tmp_path_factory.mktemp("tensor_parallel")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", port, os.path.join(HERE, "tensor_parallel_worker.py"),
                           str(models)],
                          capture_output=True, text=True, env=env, timeout=300, check=False)


@pytest.mark.e2e
@pytest.mark.parametrize("arch,untied", CASES)
def test_two_ranks_give_the_unsplit_models_outputs_gradients_and_weights(all_cases, arch, untied):
    assert all_cases.returncode == 0, all_cases.stderr[-3000:]
    sections = re.split(r"^case (\S+)\n", all_cases.stdout, flags=re.M)
    out = dict(zip(sections[1::2], sections[2::2])).get(f"{arch}:{untied}")
    assert out is not None, all_cases.stdout[-2000:]
    found = re.search(r"max_rel_logits=(\S+) max_rel_grad=(\S+) rel_norm=(\S+) own=(\d+) split=(\d+) "
                      r"full=(\d+) opt=(\d+) max_rel_export=(\S+)", out)
    assert found, out[-2000:]
    logits, grad, norm = map(float, found.group(1, 2, 3))
    own, split, full, opt = map(int, found.group(4, 5, 6, 7))
    assert logits < 1e-5 and grad < 1e-5 and norm < 1e-5 and float(found.group(8)) < 1e-5, found.group(0)
    # half of every split tensor here, the other half on the other rank; the replicated rest whole on both
    assert split > 0.3 * full and full - own == split, found.group(0)
    assert opt == 2 * own  # AdamW's two moments of what this rank holds (ZeRO-0)
