"""The safetensors reader behind ZeRO-3 sharded loading (`models/shard_loading.py`): the byte ranges it
reads are the flattened slices of each tensor, for every dtype a checkpoint uses. The 2-rank loads
themselves are tested in tests/trainers (SFT/DPO/RM) and tests/trainers/rl/test_rl_zero3.py."""
import pytest
import torch
from safetensors.torch import save_file

from posttrain.models import load_causal_lm
from posttrain.models.shard_loading import _read_flat, safetensors_keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_flat_ranges_equal_the_flattened_tensor(tmp_path, dtype):
    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": (torch.randn(7, 5, generator=g) * 100).to(dtype),
               "b.bias": (torch.randn(11, generator=g) * 100).to(dtype), "c": torch.tensor(3).to(dtype)}
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    where = safetensors_keys(str(tmp_path))
    assert set(where) == set(tensors)
    for name, t in tensors.items():
        file, entry = where[name]
        assert entry["dtype"] == dtype and tuple(entry["shape"]) == tuple(t.shape)
        flat = t.reshape(-1)
        with open(file, "rb") as f:
            for lo, hi in [(0, flat.numel()), (0, 1), (3, 9), (flat.numel() - 1, flat.numel()), (2, 2)]:
                if hi <= flat.numel():
                    assert torch.equal(_read_flat(f, entry, lo, hi), flat[lo:hi])


def test_a_folder_without_safetensors_or_with_an_unknown_dtype_is_left_to_transformers(tmp_path):
    assert safetensors_keys(str(tmp_path)) == {}
    save_file({"x": torch.zeros(2, dtype=torch.float8_e4m3fn)}, str(tmp_path / "model.safetensors"))
    assert safetensors_keys(str(tmp_path)) == {}


WORKER = """
import json, sys, torch
from posttrain.config.sections import DSConfig
from posttrain.engines.zero3 import FrozenShards, shard_numel, sharded_loading
from posttrain.models import load_causal_lm
with sharded_loading(DSConfig(param_dtype="fp32"), 3):
    model = load_causal_lm(sys.argv[1])
held = shard_numel(model)
with torch.no_grad():
    logits = FrozenShards(model).module(input_ids=torch.tensor([[5, 6, 7, 8]])).logits
if torch.distributed.get_rank() == 0:
    json.dump({"held": held, "logits": logits.flatten().tolist()}, open(sys.argv[2], "w"))
"""


@pytest.mark.e2e
def test_a_checkpoint_with_other_tensor_names_loads_through_transformers(tiny_model_dir, tmp_path):
    """A tensor name the model does not have (older naming) sends the load to transformers' ZeRO-3 path, with
    a note: still sharded, the renamed tensor freshly initialised (as transformers does), the rest loaded."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    from safetensors.torch import load_file

    folder = tmp_path / "renamed"
    shutil.copytree(tiny_model_dir, folder)
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.final_norm.weight"] = weights.pop("model.norm.weight") * 2
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "worker.py").write_text(WORKER)
    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           str(tmp_path / "worker.py"), str(folder), str(out)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "its tensor names differ from the model's (model.norm.weight" in proc.stderr
    result = json.loads(out.read_text())
    own, full = result["held"]
    assert own < 0.6 * full
    whole = load_causal_lm(str(folder))  # transformers' own load of the same folder, one process
    with torch.no_grad():
        expected = whole(input_ids=torch.tensor([[5, 6, 7, 8]])).logits.flatten()
    assert torch.allclose(torch.tensor(result["logits"]), expected, atol=1e-5)
