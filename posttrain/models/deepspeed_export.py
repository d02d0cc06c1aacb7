"""A DeepSpeed ZeRO checkpoint (stage 1, 2 or 3; OpenRLHF's `ckpt_path/_actor/global_stepN`, or any other run's)
turned into a plain Hugging Face folder: the fp32 weights DeepSpeed's `zero_to_fp32` reassembles from every
rank's partition, put into the architecture of a base model folder and saved with its tokenizer.

Safety: DeepSpeed's reader unpickles its files. Here every file is read with `torch.load(weights_only=True)`,
which allows tensors, plain containers and the three DeepSpeed classes its files hold (`LossScaler`,
`fragment_address`, `ZeroStageEnum`); any other object (e.g. a function a crafted file would call) is refused
before anything runs.

Key names: a checkpoint of a wrapper (OpenRLHF's `Actor` holds the HF model as `.model`) stores `model.<hf name>`;
the prefix is dropped when that is what makes the names match the base model's. OpenRLHF's reward model and critic
store their head as `value_head.*`: it becomes the score model's `score.*`."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from posttrain.utils.errors import UserError


def resolve_tag(checkpoint: str | os.PathLike, tag: str | None) -> tuple[Path, str]:
    """(the folder holding tag folders, the tag): `checkpoint` may be that folder (tag from `tag` or its `latest`
    file) or a tag folder itself."""
    path = Path(checkpoint)
    if not path.is_dir():
        raise UserError(f"--checkpoint {path}: no such folder")
    if tag is None and any(path.glob("*model_states.pt")):
        return path.parent, path.name
    if tag is None:
        latest = path / "latest"
        if not latest.is_file():
            raise UserError(f"--checkpoint {path}: no `latest` file and no model_states.pt files; pass --tag (e.g. "
                            "global_step100) or the tag folder itself")
        tag = latest.read_text().strip()
    if not (path / tag).is_dir():
        raise UserError(f"--checkpoint {path}: no tag folder {tag!r}")
    return path, tag


@contextlib.contextmanager
def weights_only_loads():
    """While inside, `torch.load` reads with weights_only=True, allowing DeepSpeed's three plain classes."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    real = torch.load

    def load(*args, **kwargs):
        kwargs["weights_only"] = True
        with torch.serialization.safe_globals([LossScaler, fragment_address, ZeroStageEnum]):
            try:
                return real(*args, **kwargs)
            except Exception as err:  # pickle.UnpicklingError, or what a refused global raises
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise UserError(f"{args[0] if args else kwargs.get('f')}: refused to read ({first}); the file holds "
                                "objects other than tensors and DeepSpeed's own plain types") from None

    torch.load = load
    try:
        yield
    finally:
        torch.load = real


def zero_fp32_state(checkpoint, tag: str | None = None) -> dict[str, torch.Tensor]:
    """The whole fp32 weights of a ZeRO checkpoint (frozen parameters included when it saved them)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    folder, tag = resolve_tag(checkpoint, tag)
    with weights_only_loads():
        try:
            return dict(get_fp32_state_dict_from_zero_checkpoint(str(folder), tag=tag))
        except (FileNotFoundError, ValueError) as err:
            raise UserError(f"--checkpoint {folder / tag}: not a readable DeepSpeed ZeRO checkpoint ({err})") from None


def matched_names(state: dict[str, torch.Tensor], wanted: set[str]) -> dict[str, torch.Tensor]:
    """`state` under the base model's names: as they are, or without a wrapper's `model.` prefix; a score head
    stored as `value_head.*` (OpenRLHF's reward model and critic) as `score.*`."""
    heads = {k.replace("value_head.", "score.", 1) if k.startswith("value_head.") else k: v for k, v in state.items()}
    for strip in ("", "model."):
        renamed = {(k[len(strip):] if strip and k.startswith(strip) else k): v for k, v in heads.items()}
        if wanted <= set(renamed):
            return {k: v for k, v in renamed.items() if k in wanted}
    missing = sorted(wanted - set(state))[:3]
    raise UserError(f"the checkpoint's tensors do not match the base model's (missing e.g. {missing}; the checkpoint "
                    f"has e.g. {sorted(state)[:3]}): pass the base model the run started from")


def export_zero_checkpoint(checkpoint, base, output, tag: str | None = None, dtype: str = "bf16",
                           score: bool = False) -> Path:
    """Write `output`: the base model folder's architecture and tokenizer with the checkpoint's weights in
    `dtype`; `score`: a reward model / critic (a sequence-classification head)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from posttrain.models.loading import check_model_path, load_tokenizer, parse_dtype
    from posttrain.models.saving import save_pretrained

    state = zero_fp32_state(checkpoint, tag)
    path = check_model_path(base)
    config = AutoConfig.from_pretrained(path, **({"num_labels": 1} if score else {}))
    cls = AutoModelForSequenceClassification if score else AutoModelForCausalLM
    with torch.device("meta"):
        model = cls.from_config(config)
    wanted = set(model.state_dict()) - {k for k in model.state_dict() if _tied(model, k)}
    weights = matched_names(state, wanted)
    model = cls.from_config(config, dtype=parse_dtype(dtype))
    model.load_state_dict(weights, strict=False, assign=False)
    model.tie_weights()
    save_pretrained(model, load_tokenizer(path), output)
    return Path(output)


def _tied(model, key: str) -> bool:
    """A tied copy (e.g. lm_head.weight with tied embeddings): a checkpoint may store it or not."""
    return getattr(model.config, "tie_word_embeddings", False) and key in (getattr(model, "_tied_weights_keys",
                                                                                   None) or {})
