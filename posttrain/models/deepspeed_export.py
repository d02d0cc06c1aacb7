"""A DeepSpeed ZeRO checkpoint (stage 1, 2 or 3; OpenRLHF's `ckpt_path/_actor/global_stepN`, or any other
run's) turned into a plain Hugging Face folder: the fp32 weights DeepSpeed's `zero_to_fp32` reassembles from
every rank's partition, put into the architecture of a base model folder and saved with its tokenizer.

Safety: DeepSpeed's reader unpickles its files. Here every file is read with `torch.load(weights_only=True)`,
which allows tensors, plain containers and the three DeepSpeed classes its files hold (`LossScaler`,
`fragment_address`, `ZeroStageEnum`); any other object (e.g. a function a crafted file would call) is refused
before anything runs.

Key names: a checkpoint of a wrapper (OpenRLHF's `Actor` holds the HF model as `.model`) stores `model.<hf
name>`; the prefix is dropped when that is what makes the names match the base model's. OpenRLHF's reward
model and critic store their head as `value_head.*`: it becomes the score model's `score.*`. A base model with
a `vision_config` (a vision-language model) is rebuilt as one (`AutoModelForImageTextToText`) and saved with
its image processor. posttrain's own one-process checkpoints (plain torch engine: `engine/model.pt`) are read
too, weights-only; a posttrain checkpoint's `global_stepN` folder is read as its engine wrote it.

Output: written into a temporary sibling folder, then renamed into place, so a failed conversion leaves
nothing behind. A non-empty output folder is replaced only with `overwrite`; a folder that is, or lies below,
a posttrain checkpoint or run folder (`run_folder_at`) is never written, and `overwrite` never deletes one."""
from __future__ import annotations

import contextlib
import os
import pickle
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from posttrain.utils.checkpoint import MANIFEST, load_state_file, refused_file, run_folder_at
from posttrain.utils.errors import UserError
from posttrain.utils.extras import require
from posttrain.utils.run_lock import LOCK_FILE

if TYPE_CHECKING:
    import torch


def resolve_tag(checkpoint: str | os.PathLike, tag: str | None) -> tuple[Path, str]:
    """(the folder holding tag folders, the tag): `checkpoint` may be that folder (tag from `tag` or its
    `latest` file) or a tag folder itself."""
    path = Path(checkpoint)
    if not path.is_dir():
        raise UserError(f"--checkpoint {path}: no such folder")
    if tag is None and any(path.glob("*model_states.pt")):
        return path.parent, path.name
    if tag is None:
        latest = path / "latest"
        if not latest.is_file():
            raise UserError(f"--checkpoint {path}: no `latest` file and no model_states.pt files; pass --tag "
                            f"(e.g. global_step100) or the tag folder itself")
        tag = latest.read_text().strip()
    if not (path / tag).is_dir():
        raise UserError(f"--checkpoint {path}: no tag folder {tag!r}")
    return path, tag


@contextlib.contextmanager
def weights_only_loads():
    """While inside, `torch.load` reads with weights_only=True, allowing DeepSpeed's three plain classes."""
    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    real = torch.load

    def load(*args, **kwargs):
        kwargs["weights_only"] = True
        file = args[0] if args else kwargs.get("f")
        with torch.serialization.safe_globals([LossScaler, fragment_address, ZeroStageEnum]), \
                warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch's note on a pickle it then refuses
            try:
                return real(*args, **kwargs)
            except pickle.UnpicklingError as err:  # what a refused global raises, before it runs
                raise refused_file(file, err) from None
            except Exception as err:  # a truncated or overwritten file
                first = (str(err).strip().splitlines() or [type(err).__name__])[0]
                raise UserError(f"checkpoint file {file} cannot be read ({first}); it is damaged or "
                                "incomplete") from None

    torch.load = load
    try:
        yield
    finally:
        torch.load = real


def checkpoint_source(checkpoint, tag: str | None = None) -> tuple[Path, str | None]:
    """What `zero_fp32_state` reads, found without reading it: (the plain torch engine's model.pt, None) for a
    posttrain checkpoint of that engine, else (the folder holding tag folders, the tag) of a DeepSpeed
    checkpoint. UserError for a missing folder or tag, a LoRA-only posttrain checkpoint, or no DeepSpeed."""
    if tag is None and (found := posttrain_engine(checkpoint)) is not None:
        folder, engine = found
        if engine == "torch":
            return folder / "model.pt", None
        checkpoint, tag = folder, "engine"
    folder, tag = resolve_tag(checkpoint, tag)
    require(f"--checkpoint {folder / tag} (a DeepSpeed ZeRO checkpoint)", "deepspeed")
    return folder, tag


def zero_fp32_state(checkpoint, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The whole fp32 weights of a ZeRO checkpoint (frozen parameters included when it saved them). A
    posttrain checkpoint (`global_stepN` or its `engine` folder, no `tag`) is read as its engine wrote it:
    DeepSpeed's files under `engine/engine`, or the plain torch engine's `model.pt` (weights-only)."""
    folder, tag = checkpoint_source(checkpoint, tag)
    if tag is None:
        return dict(load_state_file(folder))
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with weights_only_loads():
        try:
            return dict(get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag))
        except (FileNotFoundError, ValueError) as err:
            raise UserError(f"--checkpoint {folder / tag}: not a readable DeepSpeed ZeRO checkpoint "
                            f"({err})") from None


def posttrain_engine(checkpoint) -> tuple[Path, str] | None:
    """(the engine folder, "torch" or "deepspeed") when `checkpoint` is a posttrain checkpoint's
    `global_stepN` or its `engine` folder (it holds `engine_state.json`); None otherwise. A LoRA run's
    (adapters only) is refused."""
    import json

    for folder in (Path(checkpoint), Path(checkpoint) / "engine"):
        try:
            meta = json.loads((folder / "engine_state.json").read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(meta, dict) or meta.get("engine") not in ("torch", "deepspeed"):
            return None
        if meta.get("weights") == "trainable":
            raise UserError(f"--checkpoint {folder}: the run trained LoRA adapters only and saved just "
                            "those; its final model folder (--ckpt.output_dir) or --ckpt.save_hf holds the "
                            "merged model")
        return folder, meta["engine"]
    return None


def matched_names(state: dict[str, torch.Tensor], wanted: set[str]) -> dict[str, torch.Tensor]:
    """`state` under the base model's names: as they are, or without a wrapper's `model.` prefix; a score head
    stored as `value_head.*` (OpenRLHF's reward model and critic) as `score.*`."""
    heads = {k.replace("value_head.", "score.", 1) if k.startswith("value_head.") else k: v
             for k, v in state.items()}
    for strip in ("", "model."):
        renamed = {(k[len(strip):] if strip and k.startswith(strip) else k): v for k, v in heads.items()}
        if wanted <= set(renamed):
            return {k: v for k, v in renamed.items() if k in wanted}
    missing = sorted(wanted - set(state))[:3]
    raise UserError(f"the checkpoint's tensors do not match the base model's (missing e.g. {missing}; the "
                    f"checkpoint has e.g. {sorted(state)[:3]}): pass the base model the run started from")


def check_output_folder(output, overwrite: bool = False) -> Path:
    """`output` as a folder ds-to-hf may write: not at or below a posttrain checkpoint or run folder
    (UserError whatever `overwrite` says), a new or empty folder, or with `overwrite` a folder that holds no
    such folder and is neither the working directory, the home folder nor above one of them. The checks
    and the returned path follow symlinks and `..` (`Path.resolve`)."""
    out = Path(output).resolve()
    owner = run_folder_at(out)
    if owner is not None:
        raise UserError(f"--output_path {output}: {owner} is a posttrain checkpoint or run folder, and "
                        "ds-to-hf never writes into one or below it (--overwrite included): choose a folder "
                        "outside it")
    if out.exists() and not out.is_dir():
        raise UserError(f"--output_path {output} is a file, not a folder; choose a folder path")
    names = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not names:
        return out
    if not overwrite:
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise UserError(f"--output_path {output} is not empty (it holds {shown}); pass --overwrite to "
                        "replace the whole folder, or choose a new or empty folder")
    if any(p.resolve().is_relative_to(out.resolve()) for p in (Path.cwd(), Path.home())):
        raise UserError(f"--output_path {output} holds the working directory or the home folder: --overwrite "
                        "would delete it; choose a new or empty folder")
    inner = next((p.parent for p in out.rglob("*") if p.name in (LOCK_FILE, MANIFEST)), None)
    if inner is not None:
        raise UserError(f"--output_path {output} holds {inner}, a posttrain checkpoint or run folder: "
                        "--overwrite would delete it; choose a new or empty folder")
    return out


def export_zero_checkpoint(checkpoint, base, output, tag: str | None = None, dtype: str = "bf16",
                           score: bool = False, overwrite: bool = False) -> Path:
    """Write `output` (`check_output_folder`, before anything is read; atomically): the base model folder's
    architecture, tokenizer (and a VLM's image processor) with the checkpoint's weights in `dtype`; `score`:
    a reward model / critic (a sequence-classification head). UserError (one line) for a base model of
    another shape than the checkpoint's, one with custom code (`auto_map`), or an architecture transformers
    lacks. The output and base model are checked before torch and transformers load."""
    from posttrain.models.folders import check_model_folder, check_model_path

    out = check_output_folder(output, overwrite)
    path = check_model_path(base)
    check_model_folder(path)  # config.json readable, no `auto_map` (custom code, never run)
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoModelForSequenceClassification,
    )

    from posttrain.models.loading import load_tokenizer, parse_dtype
    from posttrain.models.saving import atomic_output_dir, save_pretrained
    from posttrain.models.vision import is_vision_config, load_processor

    config = AutoConfig.from_pretrained(path, **({"num_labels": 1} if score else {}))
    vision = is_vision_config(config)
    cls = (AutoModelForSequenceClassification if score else
           AutoModelForImageTextToText if vision else AutoModelForCausalLM)
    try:
        with torch.device("meta"):
            model = cls.from_config(config)
    except ValueError:  # transformers has no such class for this architecture
        raise UserError(f"--model_path {base}: transformers has no {cls.__name__} for its architecture "
                        f"({config.model_type}); pass a base model of a supported architecture") from None
    state = zero_fp32_state(checkpoint, tag)
    wanted = set(model.state_dict()) - {k for k in model.state_dict() if _tied(model, k)}
    weights = matched_names(state, wanted)
    _check_shapes(weights, model.state_dict(), base)
    model = cls.from_config(config, dtype=parse_dtype(dtype))
    model.load_state_dict(weights, strict=False, assign=False)
    model.tie_weights()
    tokenizer = load_tokenizer(path)
    savers = [tokenizer, load_processor(path, tokenizer).image_processor] if vision else tokenizer
    with atomic_output_dir(out) as tmp:
        save_pretrained(model, savers, tmp)
    return Path(output)


def _check_shapes(weights: dict[str, torch.Tensor], own: dict[str, torch.Tensor], base) -> None:
    """UserError naming the first tensor whose shape differs from the base model's, and how many do."""
    bad = [k for k in sorted(weights) if weights[k].shape != own[k].shape]
    if bad:
        k = bad[0]
        raise UserError(f"the checkpoint's {k} has shape {tuple(weights[k].shape)}, the base model "
                        f"--model_path {base} has {tuple(own[k].shape)} ({len(bad)} tensors differ: another "
                        "vocab_size, hidden or intermediate size); pass the base model the run started from")


def _tied(model, key: str) -> bool:
    """A tied copy (e.g. lm_head.weight with tied embeddings): a checkpoint may store it or not."""
    return (getattr(model.config, "tie_word_embeddings", False)
            and key in (getattr(model, "_tied_weights_keys", None) or {}))
