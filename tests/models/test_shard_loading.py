"""The safetensors reader behind ZeRO-3 sharded loading (`models/shard_loading.py`): the byte ranges it
reads are the flattened slices of each tensor, for every dtype a checkpoint uses. The 2-rank loads
themselves are tested in tests/trainers (SFT/DPO/RM) and tests/trainers/rl/test_rl_zero3.py."""
import pytest
import torch
from safetensors.torch import save_file

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
