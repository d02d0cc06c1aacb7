"""The HF engine's generation for prompts with images (vision-language models).

The rows are prefilled together, left-padded, with their image tensors (the vision tower runs once, at
prefill); then the same sampling step as the text decode loop (`sample_next`, each row drawing from its
own generator, stop ids banned below `min_tokens`, and the image-structure tokens never sampled:
`structure_token_ids`) runs one token at a time on the KV cache until every row is done. Unlike
`decode_batch.DecodeBatch` the batch is static (rows neither join nor leave, no shared prompt prefill). A
multi-axis rotary family's prefill with images passes no position ids: the model derives them from the mask
and the image grid, and keeps each row's offset (`rope_deltas`), from which the decode steps continue
(`_next_positions`); any other prefill (a plain-rotary family such as Gemma 4, a batch without images) passes
each row's text positions (`_prefill_positions`). Log-probs are those of the full temperature-scaled
distribution, as the trainer recomputes them from the padded prompt + response.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from posttrain.data.collate import merge_image_inputs
from posttrain.models.vision import config_token_id, vision_forward_inputs
from posttrain.rollout.decode_batch import Sequence, _banned
from posttrain.rollout.sampling import sample_next


def decode_with_images(model, new_cache, rows: list[Sequence], images: Seq[dict | None], pad_token_id: int,
                       cache_kw: str, keep_kw: bool, version: int = 0) -> None:
    """Decode `rows` to completion; `images[i]`: row i's image tensors (None: a text-only row). `cache_kw`:
    the name the model's forward takes its KV cache by; `keep_kw`: whether it takes `logits_to_keep`."""
    device = next(model.parameters()).device
    width = max(len(s.prompt) for s in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    for i, s in enumerate(rows):
        ids[i, width - len(s.prompt):] = torch.tensor(s.prompt, dtype=torch.long)
        mask[i, width - len(s.prompt):] = 1
    extra = {cache_kw: new_cache(), "use_cache": True, **({"logits_to_keep": 1} if keep_kw else {})}
    inputs = vision_forward_inputs(model, ids, merge_image_inputs(images, device))
    rotary = _rotary_offsets_owner(model)
    positions = _prefill_positions(rotary, mask, bool(inputs))
    if positions is not None:
        inputs["position_ids"] = positions
    logits = model(input_ids=ids, attention_mask=mask, **inputs, **extra).logits[:, -1].float()
    temperature, top_p = rows[0].temperature, rows[0].top_p
    never = structure_token_ids(model)
    while not all(s.done for s in rows):
        uniforms = None
        if temperature > 0:
            uniforms = torch.tensor([0.0 if s.done else s.uniform() for s in rows], dtype=torch.float64,
                                    device=device)
        tokens, logprobs = sample_next(logits, temperature, top_p, None, uniforms,
                                       _with(_banned(rows, logits), never, logits))
        for s, tok, lp in zip(rows, tokens.tolist(), logprobs.tolist()):
            if s.done:
                continue  # finished earlier: its draw is discarded
            s.tokens.append(tok)
            s.logprobs.append(lp)
            s.versions.append(version)
            s.stopped = tok in s.stop
        if all(s.done for s in rows):
            break
        mask = torch.cat([mask, torch.ones(len(rows), 1, dtype=torch.long, device=device)], dim=1)
        logits = model(input_ids=tokens[:, None], attention_mask=mask,
                       position_ids=_next_positions(rotary, mask), **extra).logits[:, -1].float()


def structure_token_ids(model) -> list[int]:
    """The ids that mark images in a sequence (image / video placeholders, vision start / end): never sampled.
    The model places image features at every image token of its input, so a sampled one would have no
    image behind it and the training pass would fail; the log-probs stay those of the full distribution."""
    kinds = ("image", "video", "vision_start", "vision_end", "boi", "eoi")
    return sorted({t for t in (config_token_id(model.config, kind) for kind in kinds) if t is not None})


def _with(banned: torch.Tensor | None, ids: list[int], logits: torch.Tensor) -> torch.Tensor | None:
    """`banned` ([B, V] bool, or None: nothing banned) with `ids` banned in every row as well."""
    ids = [i for i in ids if i < logits.shape[-1]]
    if not ids:
        return banned
    if banned is None:
        banned = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    banned[:, ids] = True
    return banned


def _rotary_offsets_owner(model) -> torch.nn.Module | None:
    """The submodule that keeps a multi-axis rotary family's per-row offsets (`rope_deltas`: the family's base
    model, under its generation head and any peft wrapper); None for a plain-rotary family (Gemma 4)."""
    return next((m for m in model.modules() if "rope_deltas" in vars(m)), None)


def _prefill_positions(rotary, mask: torch.Tensor, with_images: bool) -> torch.Tensor | None:
    """The prefill's position ids: None where the model derives them itself (`rotary`, a multi-axis rotary
    family's offsets owner, given images: from the mask and the image grid); otherwise each row's text
    positions (`cumsum(mask) - 1`, from its first real token), which `_next_positions` continues. Without them
    a left-padded row would start at its padding's length (the model's default positions ignore the mask:
    Gemma 4, a Qwen-VL batch without images) while its decode steps continue from its text positions. A
    multi-axis family's offsets left from an earlier batch are dropped: a batch without images has none."""
    if rotary is not None:
        if with_images:
            return None
        rotary.rope_deltas = None
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def _next_positions(rotary, mask: torch.Tensor) -> torch.Tensor:
    """The position ids of each row's newest token: its text position (`cumsum(mask) - 1`), shifted by the
    row's rotary offset where `rotary` (`_rotary_offsets_owner`) keeps one from the prefill (`rope_deltas`:
    the image tokens of a multi-axis rotary family take fewer positions than tokens), on each of
    its rotary axes."""
    text = (mask.long().cumsum(-1) - 1)[:, -1:]
    deltas = getattr(rotary, "rope_deltas", None)
    if deltas is None:
        return text
    return (text + deltas.to(text.device)).unsqueeze(0).expand(3, -1, -1)
