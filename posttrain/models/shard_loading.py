"""Loading a model straight into ZeRO-3 shards, each rank reading only its own slice of the checkpoint.

Under a live `HfDeepSpeedConfig` (posttrain.engines.zero3.sharded_loading), transformers builds the
model under `deepspeed.zero.Init`, but it then reads the whole checkpoint into rank 0's CPU memory and
scatters it one gathered module at a time: rank 0's host peak is the whole model plus its shard. Here
the model is built the same way with an empty state dict (nothing read), then every rank copies
into its partition `p.ds_tensor` exactly the elements it owns — DeepSpeed's layout: the flattened
tensor cut into `world` equal parts (the last one padded), rank r holding elements
`[r·n, (r+1)·n)` — reading only their bytes from the safetensors file (plain reads at the offsets its
header gives). No rank ever holds more than its shard plus one slice being copied. Parameters the checkpoint
lacks (a new score head) are then initialised from the RNG state the load started from, as an unsharded
load initialises them.

Used only for local folders of safetensors files whose tensor names are the model's own; anything
else (renamed keys, other formats, quantised loads) goes through transformers' path."""
from __future__ import annotations

import contextlib
import glob
import json
import math
import os

import torch


def zero3_loading() -> bool:
    """Whether transformers builds models under `deepspeed.zero.Init` right now."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled()


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def safetensors_keys(folder: str | None) -> dict[str, tuple[str, dict]]:
    """Tensor name -> (file, header entry: dtype, shape, data_offsets) of a local folder's safetensors
    files (empty when there are none, or when one holds a dtype this reader does not know)."""
    where: dict[str, tuple[str, dict]] = {}
    for file in sorted(glob.glob(os.path.join(folder, "*.safetensors"))) if folder else []:
        with open(file, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        base = 8 + size
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if entry["dtype"] not in _DTYPES:
                return {}
            begin, _ = entry["data_offsets"]
            where[name] = (file,
                           {"dtype": _DTYPES[entry["dtype"]], "shape": entry["shape"], "start": base + begin})
    return where


def _own_range(param: torch.Tensor) -> tuple[int, int]:
    """[lo, hi) of the flattened whole tensor held by this rank's partition of a ZeRO-3 parameter."""
    size = param.ds_tensor.ds_numel
    rank = torch.distributed.get_rank(group=param.ds_process_group)
    lo = min(size * rank, param.ds_numel)
    return lo, min(lo + size, param.ds_numel)


def _read_flat(f, entry: dict, lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of the flattened (row-major) tensor `entry`, read from the open file `f`: only
    their bytes (a plain read, so the file's pages are not mapped into the process)."""
    dtype = entry["dtype"]
    item = torch.empty((), dtype=dtype).element_size()
    buf = bytearray((hi - lo) * item)
    f.seek(entry["start"] + lo * item)
    if f.readinto(buf) != len(buf):
        raise ValueError(f"{f.name}: the file ends inside a tensor")
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype) if buf else torch.empty(0, dtype=dtype)


def renamed_to_module(model: torch.nn.Module,
                      where: dict[str, tuple[str, dict]]) -> dict[str, tuple[str, dict]]:
    """`where` (checkpoint name -> location) under the module's names, renamed as `from_pretrained` renames
    checkpoint keys for the model's class (transformers' weight renamings: e.g. a Qwen2.5-VL checkpoint's
    `model.*` / `visual.*` are the module's `model.language_model.*` / `model.visual.*`). The renamings that
    changed a name are recorded on the model (`_weight_conversions`), as `from_pretrained` records them, so
    that saving writes the checkpoint's own names again. Unchanged where transformers has no renamings."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # older transformers: names as they are
        return where
    renamings = [t for t in get_model_conversion_mapping(model, add_legacy=True) if type(t) is WeightRenaming]
    out, used = {}, []
    for name, location in where.items():
        for renaming in renamings:
            renamed, _ = renaming.rename_source_key(name)
            if renamed != name and renaming not in used:
                used.append(renaming)
            name = renamed
        out[name] = location
    if used:
        model._weight_conversions = used
    return out


def fill_shards(model: torch.nn.Module, where: dict[str, tuple[str, dict]]) -> list[str]:
    """Copy every parameter and buffer found in the checkpoint (`where`, from `safetensors_keys`) into
    `model`'s partitions (whole tensors for unpartitioned ones); returns the parameter names the
    checkpoint lacks. A tensor whose shape differs from the model's is an error naming it."""
    tensors = dict(model.named_parameters())
    missing = [n for n in tensors if n not in where]
    tensors.update((n, b) for n, b in model.named_buffers() if n in where)
    with contextlib.ExitStack() as stack, torch.no_grad():
        files: dict[str, object] = {}
        for name, t in tensors.items():
            if name not in where:
                continue
            file, entry = where[name]
            shape = tuple(t.ds_shape) if hasattr(t, "ds_tensor") else tuple(t.shape)
            if tuple(entry["shape"]) != shape:
                raise ValueError(f"{file}: tensor {name} has shape {tuple(entry['shape'])}, the model's is "
                                 f"{shape}")
            if file not in files:
                files[file] = stack.enter_context(open(file, "rb"))
            if hasattr(t, "ds_tensor"):
                lo, hi = _own_range(t)
                if hi > lo:
                    t.ds_tensor.data[: hi - lo].copy_(_read_flat(files[file], entry, lo, hi))
            else:
                t.data.copy_(_read_flat(files[file], entry, 0, math.prod(shape)).view(shape))
    return missing


def init_missing(model: torch.nn.Module, missing: list[str], rng_state: torch.Tensor) -> None:
    """Initialise the modules holding `missing` parameters with the model's own `_init_weights`, drawing
    from `rng_state` (where an unsharded load starts), on every rank (the RNG advances alike everywhere,
    as in unsharded runs), rank 0's values scattered to the shards."""
    import deepspeed

    torch.random.set_rng_state(rng_state)
    owners = []
    for name in missing:
        module = model.get_submodule(name.rpartition(".")[0])
        if module not in owners:
            owners.append(module)
    if not owners:
        return
    params = [p for m in owners for p in m.parameters(recurse=False)]
    for p in params:  # built under zero.Init, they were initialised (and flagged so) already
        p._is_hf_initialized = False
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0), torch.no_grad():
        for module in owners:
            model._init_weights(module)


@contextlib.contextmanager
def without_random_init():
    """Inside, a model built under zero.Init skips transformers' random initialisation of its shards
    (`initialize_weights_zero3`, which gathers module after module on every rank and cost ~2 GB of host
    peak per rank at 0.5B): `fill_shards` overwrites every weight, `init_missing` initialises the rest."""
    from transformers.integrations import deepspeed as hf_deepspeed

    real = hf_deepspeed.initialize_weights_zero3
    hf_deepspeed.initialize_weights_zero3 = lambda model: None
    try:
        yield
    finally:
        hf_deepspeed.initialize_weights_zero3 = real


@contextlib.contextmanager
def quiet_transformers():
    """transformers' load report (every key 'missing' for an empty state dict) kept out of the log."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
