"""Write a model folder atomically: into a temporary sibling, then rename into place."""
from __future__ import annotations

import errno
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from posttrain.utils.checkpoint import disk_full_reason


@contextmanager
def atomic_output_dir(out_dir):
    """Yield a temporary directory next to `out_dir`; on success it replaces `out_dir` (an old
    folder is moved aside first and deleted after), on error it is removed and `out_dir` is
    left untouched."""
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.chmod(tmp, 0o755)
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.rmdir(old)
        out.rename(old)
    tmp.rename(out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """Strip DDP / DeepSpeed / engine wrappers (anything exposing the wrapped net as `.module`)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def _without_tied_copies(model: torch.nn.Module, state_dict: dict) -> dict:
    """`state_dict` without the tied copies (e.g. `lm_head.weight` of tied embeddings): separate
    tensors (gathered ZeRO-3 weights, an EMA) do not share storage, so transformers would write them
    twice; the model's own save writes each tied weight once."""
    if not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        return state_dict
    tied = getattr(model, "_tied_weights_keys", None) or {}
    return {k: v for k, v in state_dict.items() if k not in set(tied)}


def save_pretrained(model: torch.nn.Module, tokenizer, out_dir, state_dict: dict | None = None) -> Path:
    """Save a plain HF folder (config, safetensors weights, generation config, tokenizer) that
    `from_pretrained` loads (`tokenizer` may be a list: the tokenizer and a VLM's image processor); a
    peft-wrapped model saves only its adapter (`adapter_config.json` + `adapter_model.safetensors`).
    `state_dict` overrides the model's own tensors (e.g. ZeRO-3 weights gathered by the engine). The files are
    written to a temporary folder first and then each is moved into `out_dir` with an atomic rename, so other
    files in `out_dir` (a run's metrics.jsonl, config.yaml, plots) stay, and no model file is ever half
    written. A write that fails for lack of space (`disk_full_reason`: by errno or by the free space
    left, before the partial files are removed) is re-raised as OSError(ENOSPC) naming `out_dir`."""
    model = unwrap_model(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp,
                              state_dict=None if state_dict is None
                              else _without_tied_copies(model, state_dict))
        for saver in tokenizer if isinstance(tokenizer, (list, tuple)) else [tokenizer]:
            if saver is not None:
                saver.save_pretrained(tmp)
        for f in sorted(tmp.rglob("*")):
            if f.is_file():
                target = out / f.relative_to(tmp)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(f, target)
    except Exception as e:
        reason = disk_full_reason(e, tmp)
        if reason is None:
            raise
        raise OSError(errno.ENOSPC, reason, str(out)) from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
