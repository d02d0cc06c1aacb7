"""`posttrain ds-to-hf` (`models.deepspeed_export`): a DeepSpeed ZeRO checkpoint of a 2-rank run (ZeRO-2 and
ZeRO-3) becomes a plain HF folder equal to the run's own export of the same step; a wrapper's `model.` prefix
(OpenRLHF's Actor) is dropped; a crafted file is refused before it can run anything."""
import pickle

import pytest
import torch
from safetensors.torch import load_file
from sft_helpers import sft_flags, torchrun

from posttrain.models.deepspeed_export import matched_names
from posttrain.utils.errors import UserError


@pytest.mark.e2e
@pytest.mark.parametrize("stage", [2, 3])
def test_a_zero_checkpoint_becomes_the_runs_own_export(tiny_model_dir, arithmetic_dir, tmp_path, stage):
    from posttrain.cli.main import main

    ckpt = tmp_path / "ckpt"
    torchrun("posttrain.cli.train_sft", sft_flags(tiny_model_dir, arithmetic_dir, tmp_path / "run",
                                                   "--train.micro_batch_size", "4", "--data.max_samples", "32",
                                                   "--ds.zero_stage", stage, "--ckpt.path", ckpt,
                                                   "--ckpt.save_steps", "2", "--ckpt.save_hf"))
    out = tmp_path / "hf"
    main(["ds-to-hf", "--checkpoint", str(ckpt / "global_step2" / "engine"), "--tag", "engine", "--model_path",
          tiny_model_dir, "--output_path", str(out), "--ds.param_dtype", "fp32"])
    want, got = (load_file(str(d / "model.safetensors")) for d in (ckpt / "global_step2_hf", out))
    assert want.keys() == got.keys()
    assert max(float((want[k] - got[k]).abs().max()) for k in want) == 0.0
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)  # a plain folder
    # a crafted file in its place is refused before anything in it runs
    crafted = ckpt / "global_step2" / "engine" / "engine" / "mp_rank_00_model_states.pt"
    marker = tmp_path / "ran"
    crafted.write_bytes(pickle.dumps(_Crafted(str(marker))))
    with pytest.raises(SystemExit) as exit_info:
        main(["ds-to-hf", "--checkpoint", str(ckpt / "global_step2" / "engine"), "--tag", "engine", "--model_path",
              tiny_model_dir, "--output_path", str(tmp_path / "hf2")])
    assert exit_info.value.code == 2 and not marker.exists()


class _Crafted:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))  # what unpickling it would call: creating a file


def test_a_wrappers_model_prefix_is_dropped_and_other_names_are_refused():
    state = {"model.model.embed_tokens.weight": torch.zeros(2), "model.lm_head.weight": torch.ones(2)}
    wanted = {"model.embed_tokens.weight", "lm_head.weight"}
    assert set(matched_names(state, wanted)) == wanted
    critic = {"model.layers.0.weight": torch.zeros(1), "value_head.weight": torch.ones(1)}  # OpenRLHF's critic
    assert set(matched_names(critic, {"model.layers.0.weight", "score.weight"})) == {"model.layers.0.weight",
                                                                                      "score.weight"}
    with pytest.raises(UserError, match="do not match the base model's"):
        matched_names({"transformer.h.0.weight": torch.zeros(1)}, wanted)
